"""The streamq wire protocol, sans-IO: frames, messages and connection state.

Bytes in, events out; events in, bytes out. Nothing here touches a socket, an
event loop or a database: the asyncio server, the asyncio consumer and the
blocking client all drive this one module, and the tests drive it with no I/O
at all. The format is specified in ``docs/protocol.md``; section names quoted
in comments below refer to it.

A connection is driven like h11::

    conn = ServerConnection()
    out = conn.send(ServerHello(...))      # bytes to write
    conn.receive_data(data)                # bytes read from the peer
    while (event := conn.next_event()) is not None:
        ...                                # a message, checked for order
"""

from __future__ import annotations

import contextlib
import gc
import reprlib
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from typing import Any, ClassVar, NamedTuple, TypeVar, cast

import msgpack

from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .filters import Filter, FilterError

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
# The most a client accepts when a producer announces larger frames.
MAX_ACCEPTED_FRAME_SIZE = 256 * 1024 * 1024
MAX_SEQ = 2**63 - 1

# "Framing": a 4-byte big-endian body length, then a msgpack array body.
FRAME_HEADER = struct.Struct(">I")
# Bytes a RECORDS frame adds around its records; a record may use the rest.
FRAME_OVERHEAD = 64


class MessageType(IntEnum):
    """The first element of every frame body ("Messages")."""

    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    SUBSCRIBE = 3
    SUBSCRIBED = 4
    RECORDS = 5
    HEARTBEAT = 6
    ACK = 7
    GET_HEAD = 8
    STREAM_INFO = 9
    GET_RANGE = 10
    RANGE_END = 11
    LIST_STREAMS = 12
    STREAM_LIST = 13
    GET_STATUS = 14
    STATUS_REPORT = 15
    ERROR = 16
    REPORT_POSITION = 17
    GET_HISTORY = 18
    SEEK_TIME = 19
    TIME_POSITION = 20
    AUTHENTICATED = 26


class Record(NamedTuple):
    """One record of a stream, as a consumer receives it.

    ``timestamp`` is milliseconds since the Unix epoch, taken when it was published.
    """

    seq: int
    timestamp: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]


def encode_record(
    seq: int, timestamp: int, key: bytes | None, value: bytes, headers: dict[str, bytes]
) -> bytes:
    """A record's wire encoding; producers store exactly these bytes.

    Storing the encoded form lets the server build RECORDS frames by
    concatenation, with no decode and re-encode per record.
    """
    return _packb([seq, timestamp, key, value, headers])


_packb: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack


def encode_values(first_seq: int, timestamp: int, values: Sequence[bytes]) -> list[bytes]:
    """``encode_record`` of each value, with no key and no headers, under consecutive seqs
    from ``first_seq``: a batch's records in one pass."""
    pack = _packb
    return [pack([seq, timestamp, None, value, {}]) for seq, value in enumerate(values, first_seq)]


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


# --- Messages ("Messages" in docs/protocol.md) -------------------------------
#
# Each message class registers itself once, with ``@_message``: its fields' checks in
# wire order, and how many of its last fields are optional ("Optional fields": a frame
# may end before them, and they are then None; left as None they are not sent, so frames
# stay as they were before the fields existed).

Check = Callable[[Any], bool]


def _uint(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_SEQ


def _str(v: Any) -> bool:
    return type(v) is str


def _opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _opt_uint(v: Any) -> bool:
    return v is None or _uint(v)


def _map(v: Any) -> bool:
    return type(v) is dict


def _bin(v: Any) -> bool:
    return type(v) is bytes


def _int(v: Any) -> bool:
    return type(v) is int


def _is_version(v: Any) -> bool:
    return type(v) is int and v == PROTOCOL_VERSION


_CLASSES: dict[MessageType, type[Any]] = {}  # the class decoding each message type
_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}
_CHECKS: dict[type[Any], tuple[Check, ...]] = {}
_OPTIONAL_FIELDS: dict[type[Any], int] = {}
_M = TypeVar("_M")


def _message(*checks: Check, optional: int = 0, decoded_by: bool = True) -> Callable[[_M], _M]:
    """Register a message class: ``checks`` validate its fields in wire order (none for
    messages with a decoder of their own); ``decoded_by=False`` for a second class of one
    message type (``RecordRows``), which decoding picks by a flag."""

    def register(cls: _M) -> _M:
        message_cls = cast(type[Any], cls)
        if decoded_by:
            _CLASSES[message_cls.TYPE] = message_cls
        _FIELD_NAMES[message_cls] = tuple(f.name for f in fields(message_cls))
        _CHECKS[message_cls] = checks
        if optional:
            _OPTIONAL_FIELDS[message_cls] = optional
        return cls

    return register


class Message:
    """What every message class is: a frozen dataclass with its wire ``TYPE``."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]


@_message(_uint, _str, _opt_str, optional=1)
@dataclass(frozen=True, slots=True)
class ClientHello(Message):
    """First frame a client sends: its protocol version, a name for logs and, for producers
    that require one, a token naming the consumer ("Authentication"). Without a token the
    frame has no third field, as before tokens existed."""

    version: int
    client: str
    token: str | None = None
    TYPE: ClassVar[MessageType] = MessageType.CLIENT_HELLO


@_message(_uint, _str, _uint, _uint, _uint, optional=1)
@dataclass(frozen=True, slots=True)
class ServerHello(Message):
    """First frame the producer sends, on accept, before reading anything.

    ``heartbeat_interval_ms`` (optional, "Handshake"): how often a caught-up subscription
    hears from the producer, so a client can size its timeout instead of guessing it;
    None leaves the field off the wire, as producers that predate it do.
    """

    version: int
    producer_id: str
    epoch: int
    max_frame_size: int
    heartbeat_interval_ms: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.SERVER_HELLO


@_message(_str, _uint, _str, _opt_str, _opt_uint, _map, optional=2)
@dataclass(frozen=True, slots=True)
class Subscribe(Message):
    """Push ``stream`` from ``start_seq`` on, forever; ``producer_id`` is checked if set.

    ``seen_epoch`` (optional, "Epochs"): the highest epoch that wrote any record the client
    read up to seq ``start_seq - 1``, 0 if unknown. Sending it (even 0) asks for epochs in
    SUBSCRIBED and RECORDS; None leaves the field off the wire.

    ``filter`` (optional, "Filters"): push only the records it matches; every RECORDS
    frame then carries ``through``, so the position moves past what was skipped.
    """

    stream: str
    start_seq: int
    consumer: str
    producer_id: str | None
    seen_epoch: int | None = None
    filter: Filter | None = None
    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE


@_message(_str, _uint, _uint, _uint, _uint, optional=2)
@dataclass(frozen=True, slots=True)
class Subscribed(Message):
    """The subscription is accepted. With epochs ("Epochs"): ``after_epoch`` is the epoch that
    wrote seq ``start_seq - 1`` in the producer's log now (0 if unknown or none), and
    ``rewritten_from`` the first seq whose record differs from what the client read
    (0 if none)."""

    stream: str
    head: int
    low: int
    after_epoch: int | None = None
    rewritten_from: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBED


@_message()  # decoded by _decode_records_message
@dataclass(frozen=True, slots=True)
class Records(Message):
    """Records in increasing seq order. Servers send them with ``records_frame``.

    ``epoch`` (optional, "Epochs"): the producer instance that wrote every record of the
    frame, 0 if unknown; None leaves the field off the wire.

    ``through`` (on filtered subscriptions and ranges, "Filters"): the producer examined
    every seq up to this one; those not in ``records`` did not match. A frame may then
    carry no records at all, only progress.
    """

    records: tuple[Record, ...]
    epoch: int | None = None
    through: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.RECORDS


@_message(decoded_by=False)
@dataclass(frozen=True, slots=True)
class RecordRows(Message):
    """RECORDS as decoded for columnar readers (Arrow): rows of [seq, timestamp, key, value,
    headers], of which only the first and last seq are checked. Every row's shape, field
    types and seq order are the reader's to check, in bulk, as it builds columns; a
    connection yields these instead of ``Records`` when ``raw_records`` is set.
    """

    rows: list[list[Any]]
    epoch: int | None = None
    through: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.RECORDS


@_message(_uint)
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Sent on an idle subscription so the consumer can tell a quiet producer from a dead one."""

    head: int
    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT


@_message(_uint)
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """A consumer's durable position: every seq up to ``seq`` is applied and committed."""

    seq: int
    TYPE: ClassVar[MessageType] = MessageType.ACK


@_message(_str)
@dataclass(frozen=True, slots=True)
class GetHead(Message):
    stream: str
    TYPE: ClassVar[MessageType] = MessageType.GET_HEAD


@_message(_str, _uint, _uint)
@dataclass(frozen=True, slots=True)
class StreamInfo(Message):
    """A stream's ``head`` (last committed seq, 0 if none) and ``low`` (first seq still held)."""

    stream: str
    head: int
    low: int
    TYPE: ClassVar[MessageType] = MessageType.STREAM_INFO


@_message(_str, _uint, _uint, _opt_uint, _map, optional=2)
@dataclass(frozen=True, slots=True)
class GetRange(Message):
    """Send the records with ``start <= seq < end``, then RANGE_END.

    ``seen_epoch`` (optional, "Epochs"): the highest epoch that wrote any record the client
    read up to seq ``start - 1``, 0 if unknown. Sending it (even 0) asks for epochs in
    RECORDS and RANGE_END; None leaves the field off the wire.

    ``filter`` (optional, "Filters"): send only the records it matches, each frame with
    ``through``.
    """

    stream: str
    start: int
    end: int
    seen_epoch: int | None = None
    filter: Filter | None = None
    TYPE: ClassVar[MessageType] = MessageType.GET_RANGE


@_message(_uint, _uint, optional=2)
@dataclass(frozen=True, slots=True)
class RangeEnd(Message):
    """Ends a range (or history) answer. On a range that asked for epochs ("Epochs"):
    ``after_epoch`` is the epoch that wrote seq ``start - 1`` in the producer's log now (0 if
    unknown or none), and ``rewritten_from`` the first seq up to ``start - 1`` whose record
    differs from what the client read (0 if none; when it is not 0, no RECORDS came)."""

    after_epoch: int | None = None
    rewritten_from: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.RANGE_END


@_message()
@dataclass(frozen=True, slots=True)
class ListStreams(Message):
    TYPE: ClassVar[MessageType] = MessageType.LIST_STREAMS


@_message()  # decoded by _decode_stream_list
@dataclass(frozen=True, slots=True)
class StreamList(Message):
    streams: tuple[StreamInfo, ...]
    TYPE: ClassVar[MessageType] = MessageType.STREAM_LIST


@_message()
@dataclass(frozen=True, slots=True)
class GetStatus(Message):
    TYPE: ClassVar[MessageType] = MessageType.GET_STATUS


@_message(_map)
@dataclass(frozen=True, slots=True)
class StatusReport(Message):
    """A free-form map: producer id, streams, connected consumers (docs/protocol.md)."""

    status: dict[str, Any]
    TYPE: ClassVar[MessageType] = MessageType.STATUS_REPORT


@_message(_str, _str, _uint)
@dataclass(frozen=True, slots=True)
class ReportPosition(Message):
    """A reader that does not subscribe (e.g. a Spark query) tells how far it has durably read.

    ``seq`` is its last applied seq; the producer answers with the stream's STREAM_INFO.
    """

    stream: str
    consumer: str
    seq: int
    TYPE: ClassVar[MessageType] = MessageType.REPORT_POSITION


@_message(_str, _bin, _uint, _uint)
@dataclass(frozen=True, slots=True)
class GetHistory(Message):
    """Send the records of ``stream`` whose key is ``key`` with ``start <= seq < end``
    (``end`` capped at the head + 1), in seq order, then RANGE_END: one entity's
    events without reading the whole stream."""

    stream: str
    key: bytes
    start: int
    end: int
    TYPE: ClassVar[MessageType] = MessageType.GET_HISTORY


@_message(_str, _int)
@dataclass(frozen=True, slots=True)
class SeekTime(Message):
    """Ask for the first seq of ``stream`` whose timestamp is >= ``timestamp`` (ms)."""

    stream: str
    timestamp: int
    TYPE: ClassVar[MessageType] = MessageType.SEEK_TIME


@_message(_str, _uint, _uint, _uint)
@dataclass(frozen=True, slots=True)
class TimePosition(Message):
    """Answer to SEEK_TIME: ``seq`` to start from (``head + 1`` if no record is that late)."""

    stream: str
    seq: int
    head: int
    low: int
    TYPE: ClassVar[MessageType] = MessageType.TIME_POSITION


@_message(_opt_str)
@dataclass(frozen=True, slots=True)
class Authenticated(Message):
    """The answer to a CLIENT_HELLO that carried a token: the consumer it names, or nil from
    a producer that does not check tokens."""

    consumer: str | None
    TYPE: ClassVar[MessageType] = MessageType.AUTHENTICATED


@_message(_uint, _str, _map)
@dataclass(frozen=True, slots=True)
class Error(Message):
    """The last frame on a connection: why the sender is closing it."""

    code: int
    message: str
    details: dict[str, Any]
    TYPE: ClassVar[MessageType] = MessageType.ERROR


Request = (
    Subscribe
    | GetHead
    | GetRange
    | ListStreams
    | GetStatus
    | ReportPosition
    | GetHistory
    | SeekTime
)


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


def encode(message: Message) -> bytes:
    """One framed message."""
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
    values = [_to_wire(getattr(message, name)) for name in _FIELD_NAMES[cls]]
    # Optional trailing fields left as None are not sent ("Optional fields").
    required = len(values) - _OPTIONAL_FIELDS.get(cls, 0)
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


def _malformed(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(reason, ErrorCode.MALFORMED_FRAME)


def _decode_records(items: Any) -> Records:
    """Validate every record, in one tight loop: this is the consumer's hot path."""
    if type(items) is not list:
        raise _malformed("RECORDS must carry an array of records")
    records: list[Record] = []
    append = records.append
    make = Record._make
    previous = 0
    for item in items:
        if type(item) is not list or len(item) != 5:
            raise _malformed("a record must be an array of 5 elements")
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
            raise _malformed(f"record {_short(seq)} has a field of the wrong type")
        if seq <= previous:
            raise _malformed(f"RECORDS out of order: seq {seq} after {previous}")
        previous = seq
        append(make(item))
    if previous > MAX_SEQ:
        raise _malformed(f"seq {previous} is beyond the largest seq")
    return Records(tuple(records))


def _decode_stream_list(items: Any) -> StreamList:
    if type(items) is not list:
        raise _malformed("STREAM_LIST must carry an array")
    streams = []
    for item in items:
        if not (
            type(item) is list
            and len(item) == 3
            and _str(item[0])
            and _uint(item[1])
            and _uint(item[2])
        ):
            raise _malformed("a STREAM_LIST entry must be [name, head, low]")
        streams.append(StreamInfo(*item))
    return StreamList(tuple(streams))


def _decode_record_rows(items: Any) -> RecordRows:
    """Check only what the connection state needs: the first and last record's seq."""
    if type(items) is not list:
        raise _malformed("RECORDS must carry an array of records")
    for row in (items[0], items[-1]) if items else ():
        if not (type(row) is list and len(row) == 5 and _uint(row[0]) and row[0] >= 1):
            raise _malformed("a record must be an array of 5 elements, starting with its seq")
    return RecordRows(items)


_LARGE_BODY = 16 * 1024  # decoding this many bytes makes hundreds of Python objects or more


def decode_message(body: bytes, *, raw_records: bool = False) -> Message:
    """Parse and validate one frame body; raises ``RemoteProtocolError``.

    With ``raw_records``, RECORDS decode to ``RecordRows`` instead of ``Records``.
    """
    try:
        if len(body) < _LARGE_BODY:
            return _decode_message(body, raw_records)
        with collector_paused():
            return _decode_message(body, raw_records)
    except RecursionError:  # a deeply nested value where a scalar belongs
        raise _malformed("frame body is nested too deeply") from None


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
        raise _malformed(f"frame body is not valid msgpack: {exc}") from None
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise _malformed("frame body must be an array starting with a message type")
    try:
        cls = _CLASSES[MessageType(obj[0])]
    except ValueError:
        raise _malformed(f"unknown message type {obj[0]}") from None
    args = obj[1:]
    if cls is StreamList:
        if len(args) != 1:
            raise _malformed(f"{cls.TYPE.name} takes 1 field, got {len(args)}")
        return _decode_stream_list(args[0])
    if cls is Records:
        return _decode_records_message(args, raw_records)
    if cls in (ClientHello, ServerHello) and args and not _is_version(args[0]):
        # "Handshake", version check: anything but the integer 1 first (1.0 and true
        # too) is another version, whatever follows, since other fields may differ there.
        raise RemoteProtocolError(
            f"peer speaks protocol version {_short(args[0])}, this side speaks {PROTOCOL_VERSION}",
            ErrorCode.VERSION_MISMATCH,
        )
    checks = _CHECKS[cls]
    optional = _OPTIONAL_FIELDS.get(cls, 0)
    if not len(checks) - optional <= len(args) <= len(checks):
        expected = f"{len(checks) - optional} to {len(checks)}" if optional else len(checks)
        raise _malformed(f"{cls.TYPE.name} takes {expected} fields, got {len(args)}")
    for name, check, value in zip(_FIELD_NAMES[cls], checks, args, strict=False):
        if not check(value):
            raise _malformed(f"{cls.TYPE.name}.{name} has an invalid value: {_short(value)}")
    if cls in (Subscribe, GetRange):
        # ``seen_epoch`` may be nil only to reach the filter after it.
        if len(args) == len(checks):
            args[-1] = _decode_filter(args[-1])
        elif len(args) == len(checks) - 1 and args[-1] is None:
            raise _malformed(f"{cls.TYPE.name}.seen_epoch is nil with no filter after it")
    message: Message = cls(*args)  # omitted trailing fields take their default, nil
    return message


def _decode_records_message(args: list[Any], raw_records: bool) -> Records | RecordRows:
    """[records, epoch?, through?]: ``epoch`` may be nil only when ``through`` follows."""
    if not 1 <= len(args) <= 3:
        raise _malformed(f"RECORDS takes 1 to 3 fields, got {len(args)}")
    epoch = args[1] if len(args) >= 2 else None
    through = args[2] if len(args) == 3 else None
    if len(args) >= 2 and not (_uint(epoch) or (epoch is None and len(args) == 3)):
        raise _malformed(f"RECORDS.epoch has an invalid value: {_short(epoch)}")
    if len(args) == 3 and not _uint(through):
        raise _malformed(f"RECORDS.through has an invalid value: {_short(through)}")
    message: Records | RecordRows
    if raw_records:
        message = RecordRows(_decode_record_rows(args[0]).rows, epoch, through)
    else:
        message = Records(_decode_records(args[0]).records, epoch, through)
    seqs = _first_and_last_seq(message)
    if through is not None and seqs is not None and through < seqs[1]:
        raise _malformed(f"RECORDS.through {through} is before the frame's last seq {seqs[1]}")
    return message


def _decode_filter(wire: Any) -> Filter:
    try:
        return Filter.from_wire(wire)
    except FilterError as exc:
        raise _malformed(f"invalid filter: {exc}") from None


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
                raise _malformed("empty frame")
            end = pos + FRAME_HEADER.size + size
            if len(buffer) >= end:
                self._pos = end
                with memoryview(buffer) as view:  # one copy, not a slice's two
                    return view[pos + FRAME_HEADER.size : end].tobytes()
        if pos:
            del buffer[:pos]
            self._pos = 0
        return None


# --- Connection state ("Connection states" in docs/protocol.md) --------------


class State(Enum):
    AWAIT_HELLO = "await hello"
    AUTHENTICATING = "authenticating"  # the server owes AUTHENTICATED: the hello had a token
    READY = "ready"
    STREAMING = "streaming"
    CLOSED = "closed"


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


# What the client may receive while the oldest request waiting for its answer is of each
# kind; the last message of an answer ends it. SUBSCRIBE is answered by SUBSCRIBED.
_RESPONSES: dict[type[Any], tuple[type[Any], ...]] = {
    Subscribe: (Subscribed,),
    GetHead: (StreamInfo,),
    GetRange: (Records, RecordRows, RangeEnd),
    ListStreams: (StreamList,),
    GetStatus: (StatusReport,),
    ReportPosition: (StreamInfo,),
    GetHistory: (Records, RecordRows, RangeEnd),
    SeekTime: (TimePosition,),
}
_FINAL_RESPONSES = (Subscribed, StreamInfo, RangeEnd, StreamList, StatusReport, TimePosition)
_REQUESTS = tuple(r for r in _RESPONSES if r is not Subscribe)

# "Connection states", in one place: for each role, in each state, the messages that
# role may send and the state each leads to. A message missing from its sender's row is
# out of order. ERROR is legal in every state and closes the connection (``_Connection``).
_TRANSITIONS: dict[Role, dict[State, dict[type[Any], State]]] = {
    Role.CLIENT: {
        State.AWAIT_HELLO: {ClientHello: State.READY},
        State.READY: {**dict.fromkeys(_REQUESTS, State.READY), Subscribe: State.STREAMING},
        State.STREAMING: {Ack: State.STREAMING},
    },
    Role.SERVER: {
        State.AWAIT_HELLO: {ServerHello: State.READY},
        State.AUTHENTICATING: {Authenticated: State.READY},
        State.READY: {
            **dict.fromkeys(
                (StreamInfo, Records, RecordRows, RangeEnd, StreamList, StatusReport),
                State.READY,
            ),
            TimePosition: State.READY,
            Subscribed: State.STREAMING,
        },
        State.STREAMING: dict.fromkeys((Records, RecordRows, Heartbeat), State.STREAMING),
    },
}
# Why a message is out of order, where the list of legal ones would not say it.
_HINTS: dict[tuple[Role, State], str] = {
    (Role.CLIENT, State.STREAMING): "ACK (one subscription per connection)",
    (Role.CLIENT, State.READY): "a request",
    (Role.SERVER, State.AUTHENTICATING): (
        "AUTHENTICATED: it answers a CLIENT_HELLO with a token, before anything else"
    ),
    (Role.SERVER, State.STREAMING): "RECORDS or HEARTBEAT (on a subscription)",
}


class _States:
    """Both roles' states on one connection, moved only by ``_TRANSITIONS``; ERROR closes.

    "Authentication": a CLIENT_HELLO with a token puts the server in AUTHENTICATING as
    soon as it has sent SERVER_HELLO, whichever of the two hellos came first.
    """

    def __init__(self) -> None:
        self.of = {Role.CLIENT: State.AWAIT_HELLO, Role.SERVER: State.AWAIT_HELLO}
        self._token = False  # a hello with a token, not yet answered

    def next_state(self, role: Role, message: Message) -> State | None:
        """Where ``role`` goes by sending ``message`` now; None if it may not."""
        return _TRANSITIONS[role].get(self.of[role], {}).get(type(message))

    def move(self, role: Role, message: Message, state: State) -> None:
        self.of[role] = state
        if isinstance(message, ClientHello) and message.token is not None:
            self._token = True
        if self._token and self.of[Role.SERVER] is State.READY:
            self.of[Role.SERVER] = State.AUTHENTICATING
            self._token = False

    def expected(self, role: Role) -> str:
        """What ``role`` may send now, for error messages."""
        state = self.of[role]
        hint = _HINTS.get((role, state))
        if hint is not None:
            return hint
        names = dict.fromkeys(cls.TYPE.name for cls in _TRANSITIONS[role].get(state, {}))
        return " or ".join(names) or "nothing"

    def close(self, *roles: Role) -> None:
        for role in roles:
            self.of[role] = State.CLOSED


class _Connection:
    """One side of a connection: the frame decoder and both roles' states."""

    our_role: ClassVar[Role]
    their_role: ClassVar[Role]

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._decoder = FrameDecoder(max_frame_size)
        self.raw_records = False  # RECORDS as RecordRows (see there), e.g. for Arrow
        self._states = _States()

    @property
    def our_state(self) -> State:
        return self._states.of[self.our_role]

    @property
    def their_state(self) -> State:
        return self._states.of[self.their_role]

    def receive_data(self, data: bytes | memoryview) -> None:
        self._decoder.feed(data)

    @property
    def buffered(self) -> int:
        return self._decoder.buffered

    def next_event(self) -> Message | None:
        """The next message from the peer, or None if more data is needed."""
        if self.their_state is State.CLOSED:
            return None
        body = self._decoder.next_frame()
        if body is None:
            return None
        message = decode_message(body, raw_records=self.raw_records)
        if isinstance(message, Error):
            # "Errors": the last frame on a connection, for both directions.
            self._states.close(Role.CLIENT, Role.SERVER)
            return message
        state = self._states.next_state(self.their_role, message)
        if state is None:
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name} while {self.their_state.value}: "
                f"expected {self._states.expected(self.their_role)}",
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        self._check_received(message)
        self._states.move(self.their_role, message, state)
        return message

    def send(self, message: Message) -> bytes:
        """The bytes for ``message``; raises ``LocalProtocolError`` if it is out of order."""
        if self.our_state is State.CLOSED:
            raise LocalProtocolError(f"cannot send {message.TYPE.name}: connection closed")
        if isinstance(message, Error):
            self._states.close(self.our_role)
            return encode(message)
        state = self._states.next_state(self.our_role, message)
        if state is None:
            raise LocalProtocolError(
                f"cannot send {message.TYPE.name} while {self.our_state.value}: "
                f"expected {self._states.expected(self.our_role)}"
            )
        self._check_sent(message)
        self._states.move(self.our_role, message, state)
        return encode(message)

    def _check_received(self, message: Message) -> None:
        """What the table cannot say about a message it allows (a role's own rules)."""

    def _check_sent(self, message: Message) -> None:
        """As ``_check_received``, for what this side sends."""


class ServerConnection(_Connection):
    """The producer's side of one connection."""

    our_role, their_role = Role.SERVER, Role.CLIENT

    def send_records(
        self,
        encoded_records: Sequence[bytes],
        epoch: int | None = None,
        through: int | None = None,
        count: int | None = None,
    ) -> bytes:
        """A RECORDS frame from stored record encodings (the hot path: no table lookup,
        RECORDS leaves the server's state as it is); ``count`` as ``records_frame``'s."""
        if self.our_state not in (State.READY, State.STREAMING):
            raise LocalProtocolError(f"cannot send RECORDS while {self.our_state.value}")
        return records_frame(encoded_records, epoch, through, count)


class ClientConnection(_Connection):
    """A consumer's or client's side of one connection.

    Tracks the requests in flight so every response is checked against what
    was asked, and checks that a subscription's records only move forward.
    """

    our_role, their_role = Role.CLIENT, Role.SERVER

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(max_frame_size)
        self._pending: deque[Request] = deque()  # answers owed, oldest first
        self._subscription: Subscribe | None = None
        self.last_seq = 0

    def _check_sent(self, message: Message) -> None:
        if isinstance(message, Subscribe):
            if self._pending:
                raise LocalProtocolError("SUBSCRIBE while requests are still pending")
            self._subscription = message
            self.last_seq = max(0, message.start_seq - 1)
        if type(message) in _RESPONSES:
            self._pending.append(cast(Request, message))

    def _check_received(self, message: Message) -> None:
        if isinstance(message, ServerHello):
            # "Limits": accept frames as large as the producer may send.
            decoder = self._decoder
            decoder.max_frame_size = max(
                decoder.max_frame_size, min(message.max_frame_size, MAX_ACCEPTED_FRAME_SIZE)
            )
        elif self.their_state is State.STREAMING:
            if isinstance(message, Records | RecordRows):
                self._check_pushed(message)
        elif not isinstance(message, Authenticated):
            self._check_answer(message)

    def _check_answer(self, message: Message) -> None:
        """An answer must be to the oldest request waiting for one, within what it asked."""
        if not self._pending:
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name}: no request pending", ErrorCode.UNEXPECTED_MESSAGE
            )
        request = self._pending[0]
        allowed = _RESPONSES[type(request)]
        if not isinstance(message, allowed):
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name} while {self.their_state.value}: expected "
                + " or ".join(c.TYPE.name for c in allowed),
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        if isinstance(message, Records | RecordRows):
            assert isinstance(request, GetRange | GetHistory)
            self._check_range_records(message, request)
        elif isinstance(message, RangeEnd):
            assert isinstance(request, GetRange | GetHistory)
            _check_range_end(message, request, self.last_seq)
        if isinstance(message, _FINAL_RESPONSES):
            self._pending.popleft()
            if not isinstance(message, Subscribed):  # a subscription counts from its start
                self.last_seq = 0

    def _check_range_records(
        self, message: Records | RecordRows, request: GetRange | GetHistory
    ) -> None:
        # "Epochs": a frame carries an epoch if and only if its range asked for epochs.
        if (message.epoch is not None) != _with_epochs(request):
            raise _malformed(
                "RECORDS with an epoch in answer to a request that did not ask for epochs"
                if message.epoch is not None
                else "RECORDS without an epoch in answer to a range that asked for epochs"
            )
        # "Filters": a frame carries ``through`` if and only if its range has a filter.
        filtered = isinstance(request, GetRange) and request.filter is not None
        if (message.through is not None) != filtered:
            raise _malformed(
                "RECORDS with through in answer to a request without a filter"
                if message.through is not None
                else "RECORDS without through in answer to a range with a filter"
            )
        # A range or a history holds only seqs in [start, end), in increasing order.
        seqs = _first_and_last_seq(message)
        if seqs is not None:
            first, last = seqs
            end = request.end
            if not (request.start <= first and last < end and first > self.last_seq):
                raise _malformed(f"RECORDS outside the requested range [{request.start}, {end})")
            self.last_seq = last
        if message.through is not None:
            if not self.last_seq <= message.through < request.end or (
                seqs is None and message.through == self.last_seq
            ):
                raise _malformed(
                    f"RECORDS.through {message.through} is not after seq {self.last_seq} "
                    f"and within the requested range [{request.start}, {request.end})"
                )
            self.last_seq = message.through

    def _check_pushed(self, message: Records | RecordRows) -> None:
        """A subscription's records only move forward, ``through`` with its filter."""
        through = message.through
        filtered = self._subscription is not None and self._subscription.filter is not None
        if (through is not None) != filtered:
            raise _malformed(
                "RECORDS without through on a subscription with a filter"
                if filtered
                else "RECORDS with through on a subscription without a filter"
            )
        seqs = _first_and_last_seq(message)
        if seqs is not None:
            if seqs[0] <= self.last_seq:
                raise _malformed(f"RECORDS went backwards: seq {seqs[0]} after {self.last_seq}")
            self.last_seq = seqs[1]
        if through is not None:
            if through < self.last_seq or (seqs is None and through == self.last_seq):
                raise _malformed(f"RECORDS.through went backwards: {through}")
            self.last_seq = through


def _with_epochs(request: GetRange | GetHistory) -> bool:
    return isinstance(request, GetRange) and request.seen_epoch is not None


def _check_range_end(message: RangeEnd, request: GetRange | GetHistory, last_seq: int) -> None:
    """Per "Epochs", RANGE_END carries the vouch if and only if the range asked for epochs; a
    range whose seqs up to ``start - 1`` were rewritten is answered by RANGE_END alone."""
    if not _with_epochs(request):
        if message.after_epoch is not None or message.rewritten_from is not None:
            raise _malformed("RANGE_END with epochs for a request that did not ask for epochs")
        return
    rewritten = message.rewritten_from
    if message.after_epoch is None or rewritten is None:
        raise _malformed("RANGE_END of a range with epochs needs after_epoch and rewritten_from")
    if rewritten and last_seq:
        raise _malformed(f"RANGE_END.rewritten_from {rewritten} after RECORDS")
    if rewritten and rewritten >= request.start:
        raise _malformed(
            f"RANGE_END.rewritten_from {rewritten} is not before the range's start {request.start}"
        )


def _first_and_last_seq(message: Records | RecordRows) -> tuple[int, int] | None:
    if isinstance(message, Records):
        records = message.records
        return (records[0].seq, records[-1].seq) if records else None
    rows = message.rows
    return (rows[0][0], rows[-1][0]) if rows else None
