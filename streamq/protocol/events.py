"""The protocol's vocabulary: every message a connection sends or receives, as data.

Split from the codec and the state machine so each can be read alone (as h11 keeps
``_events.py`` apart from its readers, writers and states): these are the frozen
dataclasses that the server, the consumer and the client construct and match on, each
registering its wire fields' checks once with ``@_message`` for the codec to use. No
bytes are made here and no order is checked; nothing here does I/O.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, NamedTuple, TypeVar, cast

from ..filters import Filter

PROTOCOL_VERSION = 1
MAX_SEQ = 2**63 - 1


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
    WATCH_HEAD = 21
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


# --- Messages ("Messages" in docs/protocol.md) -------------------------------
#
# Each message class registers itself once, with ``@_message``: its fields' checks in
# wire order, and how many of its last fields are optional ("Optional fields": a frame
# may end before them, and they are then None; left as None they are not sent, so frames
# stay as they were before the fields existed).

Check = Callable[[Any], bool]


def is_uint(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_SEQ


def is_str(v: Any) -> bool:
    return type(v) is str


def _opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _opt_uint(v: Any) -> bool:
    return v is None or is_uint(v)


def _map(v: Any) -> bool:
    return type(v) is dict


def _bin(v: Any) -> bool:
    return type(v) is bytes


def _int(v: Any) -> bool:
    return type(v) is int


def is_version(v: Any) -> bool:
    return type(v) is int and v == PROTOCOL_VERSION


# What ``@_message`` registers, read by the codec to encode and check each message.
MESSAGE_CLASSES: dict[MessageType, type[Any]] = {}  # the class decoding each message type
FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}
FIELD_CHECKS: dict[type[Any], tuple[Check, ...]] = {}
OPTIONAL_FIELDS: dict[type[Any], int] = {}
_M = TypeVar("_M")


def _message(*checks: Check, optional: int = 0, decoded_by: bool = True) -> Callable[[_M], _M]:
    """Register a message class: ``checks`` validate its fields in wire order (none for
    messages with a decoder of their own); ``decoded_by=False`` for a second class of one
    message type (``RecordRows``), which decoding picks by a flag."""

    def register(cls: _M) -> _M:
        message_cls = cast(type[Any], cls)
        if decoded_by:
            MESSAGE_CLASSES[message_cls.TYPE] = message_cls
        FIELD_NAMES[message_cls] = tuple(f.name for f in fields(message_cls))
        FIELD_CHECKS[message_cls] = checks
        if optional:
            OPTIONAL_FIELDS[message_cls] = optional
        return cls

    return register


class Message:
    """What every message class is: a frozen dataclass with its wire ``TYPE``."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]


@_message(is_uint, is_str, _opt_str, optional=1)
@dataclass(frozen=True, slots=True)
class ClientHello(Message):
    """First frame a client sends: its protocol version, a name for logs and, for producers
    that require one, a token naming the consumer ("Authentication"). Without a token the
    frame has no third field, as before tokens existed."""

    version: int
    client: str
    token: str | None = None
    TYPE: ClassVar[MessageType] = MessageType.CLIENT_HELLO


@_message(is_uint, is_str, is_uint, is_uint, is_uint, optional=1)
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


@_message(is_str, is_uint, is_str, _opt_str, _opt_uint, _map, optional=2)
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


@_message(is_str, is_uint, is_uint, is_uint, is_uint, optional=2)
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


@_message()  # decoded by codec._decode_records_message
@dataclass(frozen=True, slots=True)
class Records(Message):
    """Records in increasing seq order. Servers send them with ``codec.records_frame``.

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


class ColumnBuffers(NamedTuple):
    """A frame's records as Arrow lays out their columns, each buffer in the machine's byte
    order: int64 ``seqs``; ``timestamps`` in int64 microseconds; ``key`` and ``value`` as
    int32 offsets and their data, with a validity bitmap (LSB first) or None if no key is
    nil; ``headers`` None if no record has any, else (each record's int32 offsets into the
    entries, then the entries' keys' offsets and data, values' offsets, data and
    validity)."""

    length: int  # records
    seqs: bytes
    timestamps: bytes
    key_offsets: bytes
    key_data: bytes
    key_validity: bytes | None
    value_offsets: bytes
    value_data: bytes
    headers: tuple[bytes, bytes, bytes, bytes, bytes, bytes | None] | None

    def seq(self, index: int) -> int:
        """The seq of record ``index`` (from 0)."""
        return int.from_bytes(self.seqs[8 * index : 8 * index + 8], sys.byteorder, signed=True)


@_message(decoded_by=False)
@dataclass(frozen=True, slots=True)
class RecordColumns(Message):
    """RECORDS as the compiled decoder reads them for columnar readers: straight into
    Arrow's buffers (``columns``), every record's shape, types and seq order checked as it
    is read. A connection yields these instead of ``RecordRows`` when ``columnar_records``
    is set too and the compiled path runs (``streamq.protocol.columnar``); a frame it does
    not take (any shape but the protocol's exact one) still comes as ``RecordRows``.
    """

    columns: ColumnBuffers
    epoch: int | None = None
    through: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.RECORDS


@_message(is_uint)
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Sent on an idle subscription so the consumer can tell a quiet producer from a dead one."""

    head: int
    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT


@_message(is_uint)
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """A consumer's durable position: every seq up to ``seq`` is applied and committed."""

    seq: int
    TYPE: ClassVar[MessageType] = MessageType.ACK


@_message(is_str)
@dataclass(frozen=True, slots=True)
class GetHead(Message):
    stream: str
    TYPE: ClassVar[MessageType] = MessageType.GET_HEAD


@_message(is_str, is_uint, is_uint)
@dataclass(frozen=True, slots=True)
class StreamInfo(Message):
    """A stream's ``head`` (last committed seq, 0 if none) and ``low`` (first seq still held)."""

    stream: str
    head: int
    low: int
    TYPE: ClassVar[MessageType] = MessageType.STREAM_INFO


@_message(is_str, is_uint, is_uint, _opt_uint, _map, optional=2)
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


@_message(is_uint, is_uint, optional=2)
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


@_message()  # decoded by codec._decode_stream_list
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


@_message(is_str, is_str, is_uint)
@dataclass(frozen=True, slots=True)
class ReportPosition(Message):
    """A reader that does not subscribe (e.g. a Spark query) tells how far it has durably read.

    ``seq`` is its last applied seq; the producer answers with the stream's STREAM_INFO.
    """

    stream: str
    consumer: str
    seq: int
    TYPE: ClassVar[MessageType] = MessageType.REPORT_POSITION


@_message(is_str, _bin, is_uint, is_uint)
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


@_message(is_str, _int)
@dataclass(frozen=True, slots=True)
class SeekTime(Message):
    """Ask for the first seq of ``stream`` whose timestamp is >= ``timestamp`` (ms)."""

    stream: str
    timestamp: int
    TYPE: ClassVar[MessageType] = MessageType.SEEK_TIME


@_message(is_str, is_uint, is_uint, optional=1)
@dataclass(frozen=True, slots=True)
class WatchHead(Message):
    """Answer with the stream's STREAM_INFO once its head is beyond ``head``: a reader
    that asks every trigger (a Spark query) learns of new records without asking producers
    that have none. Answered at once, head as it is, when another message follows it, and
    after at most ``wait_ms`` (optional: the heartbeat interval if None, which leaves the
    field off the wire)."""

    stream: str
    head: int
    wait_ms: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.WATCH_HEAD


@_message(is_str, is_uint, is_uint, is_uint)
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


@_message(is_uint, is_str, _map)
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
    | WatchHead
)


# RECORDS as each kind of reader decodes them.
RecordsMessage = Records | RecordRows | RecordColumns
RECORDS_MESSAGES = (Records, RecordRows, RecordColumns)


def first_and_last_seq(message: RecordsMessage) -> tuple[int, int] | None:
    if isinstance(message, RecordColumns):
        columns = message.columns
        return (columns.seq(0), columns.seq(columns.length - 1)) if columns.length else None
    if isinstance(message, Records):
        records = message.records
        return (records[0].seq, records[-1].seq) if records else None
    rows = message.rows
    return (rows[0][0], rows[-1][0]) if rows else None
