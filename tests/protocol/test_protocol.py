"""The sans-IO protocol module, driven with no event loop and no sockets.

Round trips of every message, framing under arbitrary splits of the byte
stream, garbage and hostile frames (which may only ever raise
``RemoteProtocolError``), and the connection state machines of both roles.
"""

from __future__ import annotations

import gc
import itertools
import struct
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamq.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from streamq.filters import MAX_SHARES, Filter
from streamq.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER,
    MAX_SEQ,
    PROTOCOL_VERSION,
    Ack,
    Authenticated,
    ClientConnection,
    ClientHello,
    Error,
    FrameDecoder,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    Heartbeat,
    ListStreams,
    Message,
    MessageType,
    RangeEnd,
    Record,
    RecordRows,
    Records,
    ReportPosition,
    SeekTime,
    ServerConnection,
    ServerHello,
    State,
    StatusReport,
    StreamInfo,
    StreamList,
    Subscribe,
    Subscribed,
    TimePosition,
    WatchHead,
    decode_message,
    encode,
    encode_record,
    frame,
    records_frame,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# --- Strategies -----------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=12)
uints = st.integers(0, MAX_SEQ)
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(allow_nan=False),
    texts,
    st.binary(max_size=12),
)
# Anything msgpack carries back unchanged: lists (not tuples), maps with str keys.
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
maps = st.dictionaries(texts, values, max_size=4)
headers = st.dictionaries(texts, st.binary(max_size=8), max_size=3)
record_fields = st.tuples(
    msgpack_ints, st.none() | st.binary(max_size=8), st.binary(max_size=24), headers
)


def records_at(seqs: list[int]) -> st.SearchStrategy[tuple[Record, ...]]:
    """Records with exactly these seqs, other fields arbitrary."""
    return st.tuples(*(record_fields for _ in seqs)).map(
        lambda fields: tuple(Record(seq, *f) for seq, f in zip(seqs, fields, strict=True))
    )


seqs = st.integers(1, MAX_SEQ)  # "Records": seqs start at 1
record_tuples = (
    st.sets(seqs, max_size=20).map(sorted).flatmap(records_at)
    # Past 15 records the array header changes size: cover it.
    | st.sets(st.integers(1, 1000), min_size=14, max_size=40).map(sorted).flatmap(records_at)
)
stream_infos = st.builds(StreamInfo, texts, uints, uints)
filters = st.builds(
    Filter,
    st.none() | st.binary(max_size=12),
    st.dictionaries(texts, st.binary(max_size=8), max_size=3),
    st.none()
    | st.integers(1, MAX_SHARES).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
)


@st.composite
def filtered_records(draw: st.DrawFn) -> Records:
    """RECORDS of a filtered subscription: ``through`` at or after the last record."""
    records = draw(record_tuples)
    last = records[-1].seq if records else 0
    return Records(records, draw(st.none() | uints), draw(st.integers(max(last, 1), MAX_SEQ)))


MESSAGE_STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    ClientHello: st.builds(ClientHello, st.just(PROTOCOL_VERSION), texts, st.none() | texts),
    ServerHello: st.builds(
        ServerHello, st.just(PROTOCOL_VERSION), texts, uints, uints, st.none() | uints
    ),
    Subscribe: st.builds(
        Subscribe, texts, uints, texts, st.none() | texts, st.none() | uints, st.none() | filters
    ),
    Subscribed: st.builds(Subscribed, texts, uints, uints)
    | st.builds(Subscribed, texts, uints, uints, uints, uints),
    Records: st.builds(Records, record_tuples, st.none() | uints) | filtered_records(),
    Heartbeat: st.builds(Heartbeat, uints),
    Ack: st.builds(Ack, uints),
    GetHead: st.builds(GetHead, texts),
    StreamInfo: stream_infos,
    GetRange: st.builds(GetRange, texts, uints, uints, st.none() | uints, st.none() | filters),
    RangeEnd: st.builds(RangeEnd) | st.builds(RangeEnd, uints, uints),
    ListStreams: st.builds(ListStreams),
    StreamList: st.builds(StreamList, st.lists(stream_infos, max_size=5).map(tuple)),
    GetStatus: st.builds(GetStatus),
    ReportPosition: st.builds(ReportPosition, texts, texts, uints),
    GetHistory: st.builds(GetHistory, texts, st.binary(max_size=12), uints, uints),
    SeekTime: st.builds(SeekTime, texts, msgpack_ints),
    TimePosition: st.builds(TimePosition, texts, uints, uints, uints),
    WatchHead: st.builds(WatchHead, texts, uints, st.none() | uints),
    StatusReport: st.builds(StatusReport, maps),
    Error: st.builds(Error, st.sampled_from(ErrorCode).map(int) | uints, texts, maps),
    Authenticated: st.builds(Authenticated, st.none() | texts),
}
ALL_CLASSES = list(MESSAGE_STRATEGIES)
messages = st.one_of(*MESSAGE_STRATEGIES.values())

# "Optional fields": how many of each message's last fields may be left off.
OPTIONAL_FIELDS: dict[type[Any], int] = {
    ClientHello: 1,
    ServerHello: 1,
    Subscribe: 2,
    Subscribed: 2,
    Records: 2,
    GetRange: 2,
    RangeEnd: 2,
    WatchHead: 1,
}
# The wire kind of each field after the message type, as the message docstrings describe.
FIELD_KINDS: dict[type[Any], tuple[str, ...]] = {
    ClientHello: ("version", "str", "opt_str"),
    ServerHello: ("version", "str", "uint", "uint", "uint"),
    Subscribe: ("str", "uint", "str", "opt_str", "opt_uint", "filter"),
    Subscribed: ("str", "uint", "uint", "uint", "uint"),
    Heartbeat: ("uint",),
    Ack: ("uint",),
    GetHead: ("str",),
    StreamInfo: ("str", "uint", "uint"),
    GetRange: ("str", "uint", "uint", "opt_uint", "filter"),
    RangeEnd: ("uint", "uint"),
    ListStreams: (),
    GetStatus: (),
    StatusReport: ("map",),
    Error: ("uint", "str", "map"),
    ReportPosition: ("str", "str", "uint"),
    GetHistory: ("str", "bin", "uint", "uint"),
    SeekTime: ("str", "int"),
    TimePosition: ("str", "uint", "uint", "uint"),
    WatchHead: ("str", "uint", "uint"),
    Authenticated: ("opt_str",),
}
not_str = st.one_of(
    st.binary(max_size=8),
    msgpack_ints,
    st.booleans(),
    st.floats(),
    st.lists(scalars, max_size=2),
    st.dictionaries(texts, scalars, max_size=2),
)
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "uint": st.one_of(
        st.integers(-(2**63), -1),
        st.integers(MAX_SEQ + 1, 2**64 - 1),
        st.booleans(),  # a bool is not an int on the wire
        st.floats(),
        texts,
        st.binary(max_size=8),
        st.none(),
        st.lists(scalars, max_size=2),
        st.dictionaries(texts, scalars, max_size=2),
    ),
    "str": not_str | st.none(),
    "opt_str": not_str,
    "map": st.one_of(
        st.none(), msgpack_ints, texts, st.binary(max_size=8), st.lists(scalars, max_size=3)
    ),
    "bin": st.one_of(st.none(), texts, msgpack_ints, st.booleans(), st.lists(scalars, max_size=2)),
    "int": st.one_of(st.none(), texts, st.booleans(), st.floats(), st.binary(max_size=8)),
}
BAD_VALUES["opt_uint"] = BAD_VALUES["uint"].filter(lambda v: v is not None)
BAD_VALUES["filter"] = st.one_of(
    BAD_VALUES["map"].filter(lambda v: v is not None),  # an optional field is left off, not nil
    st.dictionaries(st.sampled_from(["key", "prefix", "share_count"]), scalars, min_size=1),
    st.builds(
        lambda v: {"key_prefix": v},
        st.one_of(texts, msgpack_ints, st.binary(min_size=1025, max_size=1030)),
    ),
    st.builds(
        lambda v: {"headers": v}, st.one_of(texts, st.dictionaries(texts, texts, min_size=1))
    ),
    st.builds(
        lambda v: {"share": v},
        st.one_of(
            msgpack_ints,
            st.lists(msgpack_ints, max_size=1),
            st.tuples(st.integers(0, 9), st.integers(-1, 0)).map(list),  # no shares
            st.integers(1, 9).map(lambda n: [n, n]),  # index beyond the count
            st.just([0, MAX_SHARES + 1]),
        ),
    ),
)
# What stands for an optional field left off, so that another field's bad value is the fault.
FILLERS: dict[str, Any] = {"opt_str": None, "opt_uint": None, "filter": {}}


def body_of(message: Message) -> bytes:
    """The body of a framed message, checking the frame header on the way."""
    framed = encode(message)
    (size,) = struct.unpack(">I", framed[:4])
    assert size == len(framed) - 4
    return framed[4:]


def split(data: st.DataObject, blob: bytes) -> list[bytes]:
    """``blob`` cut into chunks at points hypothesis picks (or one byte at a time)."""
    if len(blob) <= 1:
        return [blob] if blob else []
    mode = data.draw(st.sampled_from(["cuts", "bytes", "whole"]), label="split mode")
    if mode == "whole":
        return [blob]
    if mode == "bytes":
        return [blob[i : i + 1] for i in range(len(blob))]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(blob) - 1), max_size=12), label="cuts"))
    return [blob[a:b] for a, b in itertools.pairwise([0, *cuts, len(blob)])]


def remote_error(call: Callable[[], object]) -> RemoteProtocolError:
    """The RemoteProtocolError ``call`` raises; its code must be an ErrorCode."""
    with pytest.raises(RemoteProtocolError) as info:
        call()
    assert isinstance(info.value.code, ErrorCode)
    return info.value


def decode_error(body: bytes) -> RemoteProtocolError:
    return remote_error(lambda: decode_message(body))


def assert_reencodes(decoded: Message) -> None:
    """Whatever the decoder accepts, it accepts again once re-encoded (compared as
    bytes, so that a NaN in a free-form map does not make the message unequal)."""
    assert type(decoded) in MESSAGE_STRATEGIES
    again = decode_message(body_of(decoded))
    assert type(again) is type(decoded)
    assert encode(again) == encode(decoded)


def class_name(cls: type[Any]) -> str:
    return cls.__name__


# --- 1. Round trips ---------------------------------------------------------------


def test_strategies_cover_every_message_class() -> None:
    # RecordRows is RECORDS decoded in raw mode: see test_raw_records_decode_as_rows;
    # RecordColumns, decoded by the compiled path for columnar readers: test_columnar.py.
    # (dataclass(slots=True) replaces each class: compare names, not class objects.)
    subclasses = {cls.__name__ for cls in Message.__subclasses__()}
    read_only = {"RecordRows", "RecordColumns"}
    assert {cls.__name__ for cls in MESSAGE_STRATEGIES} | read_only == subclasses
    assert {cls.TYPE for cls in MESSAGE_STRATEGIES} == set(MessageType)
    assert set(FIELD_KINDS) | {Records, StreamList} == set(MESSAGE_STRATEGIES)


@FAST
@given(records=record_tuples)
def test_raw_records_decode_as_rows(records: tuple[Record, ...]) -> None:
    body = body_of(Records(records))
    rows = decode_message(body, raw_records=True)
    assert rows == RecordRows([list(r) for r in records])
    assert body_of(rows) == body


@pytest.mark.parametrize(
    "rows",
    [[[0, 1, None, b"", {}]], [[1, 1, None, b""]], [5], [[1, 1, None, b"", {}], [-1]], {}],
    ids=["seq 0", "4 fields", "not a row", "bad last seq", "not an array"],
)
def test_raw_records_check_first_and_last_seq(rows: Any) -> None:
    body = msgpack.packb([MessageType.RECORDS, rows])
    with pytest.raises(RemoteProtocolError) as caught:
        decode_message(body, raw_records=True)
    assert caught.value.code == ErrorCode.MALFORMED_FRAME


def test_raw_records_leave_the_middle_to_the_reader() -> None:
    rows = [[1, 0, None, b"a", {}], ["two", 0, None, 5, {}], [3, 0, None, b"c", {}]]
    body = msgpack.packb([MessageType.RECORDS, rows])
    assert decode_message(body, raw_records=True) == RecordRows(rows)
    with pytest.raises(RemoteProtocolError):
        decode_message(body)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=class_name)
@FAST
@given(data=st.data())
def test_round_trip(cls: type[Any], data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    body = body_of(message)
    decoded = decode_message(body)
    assert type(decoded) is cls
    assert decoded == message
    assert msgpack.unpackb(body)[0] == cls.TYPE.value
    assert encode(decoded) == encode(message)


@THOROUGH
@given(records=record_tuples)
def test_records_frame_matches_encode(records: tuple[Record, ...]) -> None:
    built = records_frame([encode_record(*r) for r in records])
    assert built == encode(Records(records))
    # Concatenating stored encodings gives exactly what msgpack would pack.
    assert built == frame(packb([MessageType.RECORDS.value, [list(r) for r in records]]))
    decoded = decode_message(built[4:])
    assert isinstance(decoded, Records)
    assert decoded.records == records
    assert all(type(r) is Record for r in decoded.records)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 0xFFFF, 0x10000])
def test_records_frame_array_header_sizes(count: int) -> None:
    encoded = [encode_record(seq, 0, None, b"", {}) for seq in range(1, count + 1)]
    built = records_frame(encoded)
    assert built == frame(
        packb([MessageType.RECORDS.value, [[s, 0, None, b"", {}] for s in range(1, count + 1)]])
    )
    decoded = decode_message(built[4:])
    assert isinstance(decoded, Records)
    assert [r.seq for r in decoded.records] == list(range(1, count + 1))


# --- 2. Framing under arbitrary splits ------------------------------------------------


@THOROUGH
@given(sent=st.lists(messages, max_size=8), data=st.data())
def test_frame_decoder_arbitrary_splits(sent: list[Message], data: st.DataObject) -> None:
    stream = b"".join(map(encode, sent))
    decoder = FrameDecoder()
    received = []
    for chunk in split(data, stream):
        decoder.feed(chunk)
        while (body := decoder.next_frame()) is not None:
            received.append(decode_message(body))
        assert decoder.buffered <= len(stream)
    assert received == sent
    assert decoder.buffered == 0
    assert decoder.next_frame() is None


@THOROUGH
@given(sent=st.lists(messages, min_size=1, max_size=8), data=st.data())
def test_frame_decoder_keeps_what_it_was_fed_from_a_reused_buffer(
    sent: list[Message], data: st.DataObject
) -> None:
    """As ``read_message_blocking`` feeds it: views of one buffer, overwritten by each read."""
    stream = b"".join(map(encode, sent))
    landing = bytearray(len(stream))
    received = []
    decoder = FrameDecoder()
    with memoryview(landing) as view:
        for chunk in split(data, stream):
            landing[: len(chunk)] = chunk
            decoder.feed(view[: len(chunk)])
            landing[:] = b"\xff" * len(landing)  # the next read lands in the same place
            while (body := decoder.next_frame()) is not None:
                received.append(decode_message(body))
    assert received == sent


client_requests = st.one_of(
    MESSAGE_STRATEGIES[GetHead],
    MESSAGE_STRATEGIES[GetRange],
    MESSAGE_STRATEGIES[ListStreams],
    MESSAGE_STRATEGIES[GetStatus],
    MESSAGE_STRATEGIES[ReportPosition],
    MESSAGE_STRATEGIES[GetHistory],
    MESSAGE_STRATEGIES[SeekTime],
    MESSAGE_STRATEGIES[WatchHead],
)


@THOROUGH
@given(
    hello=MESSAGE_STRATEGIES[ClientHello],
    requests=st.lists(client_requests, max_size=6),
    subscribe=st.none() | MESSAGE_STRATEGIES[Subscribe],
    acks=st.lists(MESSAGE_STRATEGIES[Ack], max_size=4),
    data=st.data(),
)
def test_server_connection_arbitrary_splits(
    hello: ClientHello,
    requests: list[Message],
    subscribe: Subscribe | None,
    acks: list[Ack],
    data: st.DataObject,
) -> None:
    sent: list[Message] = [hello, *requests]
    if subscribe is not None:
        sent += [subscribe, *acks]
    conn = ServerConnection()
    received = []
    for chunk in split(data, b"".join(map(encode, sent))):
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not None:
            received.append(event)
    assert received == sent
    assert conn.buffered == 0
    assert conn.their_state is (State.READY if subscribe is None else State.STREAMING)


# --- 3. Garbage ------------------------------------------------------------------------


def feed_garbage(conn_or_decoder: Any, chunks: list[bytes]) -> None:
    """Feed chunks, decode whatever comes out; only RemoteProtocolError may escape."""
    try:
        for chunk in chunks:
            if isinstance(conn_or_decoder, FrameDecoder):
                conn_or_decoder.feed(chunk)
                while (body := conn_or_decoder.next_frame()) is not None:
                    decode_message(body)
            else:
                conn_or_decoder.receive_data(chunk)
                while conn_or_decoder.next_event() is not None:
                    pass
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)


@THOROUGH
@given(garbage=st.binary(max_size=300), data=st.data())
def test_random_bytes_only_raise_remote_protocol_error(garbage: bytes, data: st.DataObject) -> None:
    chunks = split(data, garbage)
    feed_garbage(FrameDecoder(max_frame_size=128), chunks)
    feed_garbage(ServerConnection(max_frame_size=128), chunks)
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c"))
    client.send(GetRange("s", 1, 100))
    feed_garbage(client, chunks)


@THOROUGH
@given(garbage=st.binary(max_size=300))
def test_random_bodies_only_raise_remote_protocol_error(garbage: bytes) -> None:
    try:
        decoded = decode_message(garbage)
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert_reencodes(decoded)


@THOROUGH
@given(
    kind=st.integers(-2, 20) | msgpack_ints | scalars,
    fields=st.lists(values, max_size=5),
)
def test_random_msgpack_arrays_only_raise_remote_protocol_error(
    kind: Any, fields: list[Any]
) -> None:
    try:
        decoded = decode_message(packb([kind, *fields]))
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert type(kind) is int
        assert kind == decoded.TYPE
        assert_reencodes(decoded)


@THOROUGH
@given(message=messages, data=st.data())
def test_mutated_frames_only_raise_remote_protocol_error(
    message: Message, data: st.DataObject
) -> None:
    body = bytearray(body_of(message))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        at = data.draw(st.integers(0, len(body)), label="position")
        action = data.draw(st.sampled_from(["flip", "insert", "delete"]), label="action")
        if action == "insert" or at == len(body):
            body[at:at] = data.draw(st.binary(min_size=1, max_size=3), label="inserted")
        elif action == "flip":
            body[at] ^= data.draw(st.integers(1, 255), label="xor")
        else:
            del body[at]
    try:
        decoded = decode_message(bytes(body))
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert_reencodes(decoded)
    # And the same mutated body, framed, through both connection roles.
    chunks = split(data, frame(bytes(body)))
    feed_garbage(ServerConnection(), chunks)
    feed_garbage(hello_sent_client(), chunks)


def test_oversized_length_prefix_rejected_from_the_header_alone() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.feed(struct.pack(">I", 1025))  # no body at all
    assert remote_error(decoder.next_frame).code is ErrorCode.FRAME_TOO_LARGE

    default = FrameDecoder()
    default.feed(b"\xff\xff\xff\xff")
    assert remote_error(default.next_frame).code is ErrorCode.FRAME_TOO_LARGE

    conn = ServerConnection(max_frame_size=DEFAULT_MAX_FRAME_SIZE)
    conn.receive_data(struct.pack(">I", DEFAULT_MAX_FRAME_SIZE + 1))
    assert remote_error(conn.next_event).code is ErrorCode.FRAME_TOO_LARGE


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    body = packb([MessageType.GET_HEAD.value, "x" * 100])
    decoder = FrameDecoder(max_frame_size=len(body))
    decoder.feed(frame(body)[:4])
    assert decoder.next_frame() is None  # the limit itself is allowed: wait for the body
    decoder.feed(frame(body)[4:])
    assert decoder.next_frame() == body

    small = FrameDecoder(max_frame_size=len(body) - 1)
    small.feed(frame(body)[:4])
    assert remote_error(small.next_frame).code is ErrorCode.FRAME_TOO_LARGE


def test_zero_length_frame_is_malformed() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"\x00\x00\x00\x00")
    assert remote_error(decoder.next_frame).code is ErrorCode.MALFORMED_FRAME

    conn = ServerConnection()
    conn.receive_data(b"\x00\x00\x00\x00")
    assert remote_error(conn.next_event).code is ErrorCode.MALFORMED_FRAME


@FAST
@given(message=messages)
def test_truncated_frame_needs_more_data(message: Message) -> None:
    framed = encode(message)
    for cut in range(len(framed)):
        decoder = FrameDecoder()
        decoder.feed(framed[:cut])
        assert decoder.next_frame() is None
        assert decoder.buffered == cut
        decoder.feed(framed[cut:])
        assert decoder.next_frame() == framed[4:]
        assert decoder.next_frame() is None


@pytest.mark.parametrize(
    "trailing", [b"\x00", b"\xc0", b"\x91\x01", packb([MessageType.ACK.value, 2])]
)
def test_trailing_bytes_inside_a_body_are_malformed(trailing: bytes) -> None:
    body = packb([MessageType.ACK.value, 1]) + trailing
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME
    decoder = FrameDecoder()
    decoder.feed(frame(body))
    assert decoder.next_frame() == body  # framing is fine; the body is not


@pytest.mark.parametrize(
    "body",
    [
        packb([0]),
        packb([17]),
        packb([99, 1, 2]),
        packb([-1]),
        packb([2**40]),
        packb([2**64 - 1]),
    ],
)
def test_unknown_message_type_is_malformed(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "body",
    [
        packb([]),
        packb({"type": 7}),
        packb(7),
        packb(None),
        packb("ACK"),
        packb(b"\x07"),
        packb([True, 1]),  # a bool is not a message type
        packb([7.0, 1]),
        packb(["7", 1]),
        packb([[7], 1]),
    ],
)
def test_body_that_is_not_a_typed_array_is_malformed(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "cls", [c for c in ALL_CLASSES if c not in (ClientHello, ServerHello)], ids=class_name
)
@FAST
@given(data=st.data())
def test_wrong_field_count_is_malformed(cls: type[Any], data: st.DataObject) -> None:
    items = msgpack.unpackb(body_of(data.draw(MESSAGE_STRATEGIES[cls])))
    extra = data.draw(values, label="extra field")
    total = len(FIELD_KINDS.get(cls, ("array", "uint", "uint") if cls is Records else ("array",)))
    required = total - OPTIONAL_FIELDS.get(cls, 0)
    if required > 0 and data.draw(st.booleans(), label="drop a field"):
        del items[required:]  # one field short of the required ones
    else:
        items += [0] * (1 + total - len(items))  # every optional field given
        items.append(extra)
    assert decode_error(packb(items)).code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize("cls", [ClientHello, ServerHello], ids=class_name)
@FAST
@given(data=st.data())
def test_hello_with_wrong_field_count_is_malformed(cls: type[Any], data: st.DataObject) -> None:
    items = msgpack.unpackb(body_of(data.draw(MESSAGE_STRATEGIES[cls])))
    full = 1 + len(FIELD_KINDS[cls])
    items += [None] * (full - len(items))  # omitted nil fields written out
    if data.draw(st.booleans(), label="drop"):
        del items[data.draw(st.integers(2, full - 1 - OPTIONAL_FIELDS.get(cls, 0))) :]
    else:
        items.append(data.draw(values))
    assert decode_error(packb(items)).code is ErrorCode.MALFORMED_FRAME
    assert decode_error(packb([cls.TYPE.value])).code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "cls", [c for c, kinds in FIELD_KINDS.items() if set(kinds) - {"version"}], ids=class_name
)
@THOROUGH
@given(data=st.data())
def test_wrong_field_type_is_malformed(cls: type[Any], data: st.DataObject) -> None:
    items = msgpack.unpackb(body_of(data.draw(MESSAGE_STRATEGIES[cls])))
    kinds = FIELD_KINDS[cls]
    # Optional fields left off: give them (nil where nil is what leaving them off means).
    items += [FILLERS.get(kind, 0) for kind in kinds[len(items) - 1 :]]
    index = data.draw(
        st.sampled_from([i for i, kind in enumerate(kinds) if kind != "version"]), label="field"
    )
    items[index + 1] = data.draw(BAD_VALUES[kinds[index]], label="bad value")
    assert decode_error(packb(items)).code is ErrorCode.MALFORMED_FRAME


GOOD_RECORD = [1, 1700000000000, b"key", b"value", {"h": b"v"}]


def with_record_field(index: int, value: Any) -> bytes:
    record = list(GOOD_RECORD)
    record[index] = value
    return packb([MessageType.RECORDS.value, [record]])


@pytest.mark.parametrize(
    "body",
    [
        with_record_field(0, -1),  # negative seq
        with_record_field(0, MAX_SEQ + 1),
        with_record_field(0, True),  # bool where int expected
        with_record_field(0, 1.0),
        with_record_field(0, None),
        with_record_field(1, True),
        with_record_field(1, 1.5),
        with_record_field(1, "1700000000000"),
        with_record_field(2, "key"),  # str where bytes expected
        with_record_field(2, 7),
        with_record_field(3, "value"),  # str where bytes expected
        with_record_field(3, None),
        with_record_field(4, None),
        with_record_field(4, [["h", b"v"]]),
        with_record_field(4, {"h": "v"}),  # header value str, not bytes
        with_record_field(4, {b"h": b"v"}),  # header name bytes, not str
        with_record_field(4, {"h": None}),
        packb([MessageType.RECORDS.value, [GOOD_RECORD[:4]]]),
        packb([MessageType.RECORDS.value, [[*GOOD_RECORD, 0]]]),
        packb([MessageType.RECORDS.value, [{"seq": 1}]]),
        packb([MessageType.RECORDS.value, [None]]),
        packb([MessageType.RECORDS.value, {"records": []}]),
        packb([MessageType.RECORDS.value, None]),
        packb([MessageType.RECORDS.value]),
        packb([MessageType.RECORDS.value, [], []]),
        # Seqs must strictly increase inside one RECORDS frame.
        packb([MessageType.RECORDS.value, [GOOD_RECORD, GOOD_RECORD]]),
        packb([MessageType.RECORDS.value, [[2, *GOOD_RECORD[1:]], GOOD_RECORD]]),
        packb([MessageType.STREAM_LIST.value, [["s", 1]]]),
        packb([MessageType.STREAM_LIST.value, [["s", 1, -1]]]),
        packb([MessageType.STREAM_LIST.value, [["s", True, 1]]]),
        packb([MessageType.STREAM_LIST.value, [[b"s", 1, 1]]]),
        packb([MessageType.STREAM_LIST.value, [{"stream": "s"}]]),
        packb([MessageType.STREAM_LIST.value, None]),
        packb([MessageType.ACK.value, -1]),  # negative seq
        packb([MessageType.ACK.value, True]),  # bool where int expected
        packb([MessageType.ACK.value, 1.0]),
        packb([MessageType.GET_HEAD.value, b"stream"]),  # bytes where str expected
        packb([MessageType.SUBSCRIBE.value, "s", 1, b"consumer", None]),
        packb([MessageType.GET_RANGE.value, "s", 1, -5]),
        # "Epochs": GET_RANGE.seen_epoch and RANGE_END's vouch are uints, and optional only
        # as trailing fields.
        packb([MessageType.GET_RANGE.value, "s", 1, 5, -1]),
        packb([MessageType.GET_RANGE.value, "s", 1, 5, True]),
        packb([MessageType.GET_RANGE.value, "s", 1, 5, None]),
        packb([MessageType.GET_RANGE.value, "s", 1, 5, "3"]),
        packb([MessageType.GET_RANGE.value, "s", 1, 5, MAX_SEQ + 1]),
        packb([MessageType.GET_RANGE.value, "s", 1, 5, 3, 0]),
        packb([MessageType.RANGE_END.value, -1, 0]),
        packb([MessageType.RANGE_END.value, 3, 1.0]),
        packb([MessageType.RANGE_END.value, None, None]),
        packb([MessageType.RANGE_END.value, 3, False]),
        packb([MessageType.RANGE_END.value, 3, 0, 0]),
        packb([MessageType.ERROR.value, -1, "m", {}]),
        packb([MessageType.STATUS_REPORT.value, [["producer_id", "p"]]]),
    ],
)
def test_specific_wrong_field_types_are_malformed(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff\x07\x01",  # array32 claiming 2**32-1 elements
        b"\x92\x07\xdd\xff\xff\xff\xff\x01",
        b"\x92\x0f\xdf\xff\xff\xff\xff\xa1a\x01",  # map32
        b"\x92\x08\xdb\xff\xff\xff\xffabc",  # str32
        b"\x92\x05\x91\x95\x01\x00\xc0\xc6\xff\xff\xff\xffxyz\x80",  # bin32
        b"\xdc\xff\xff\x07",  # array16
    ],
)
def test_huge_length_headers_in_a_small_body(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME
    conn = ServerConnection()
    conn.receive_data(frame(body))
    remote_error(conn.next_event)


@pytest.mark.parametrize(
    "body",
    [
        b"\x91" * 100_000,
        b"\x91" * 100_000 + b"\x01",
        b"\x92\x07" + b"\x91" * 100_000 + b"\x01",
        b"\x92\x0f" + b"\x81\xa1a" * 100_000 + b"\x01",
        b"\x92\x05" + b"\x91" * 100_000,
    ],
    ids=["arrays", "arrays-complete", "in-ack", "maps-in-status", "in-records"],
)
def test_deeply_nested_body_is_malformed_not_a_crash(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME
    conn = ServerConnection()
    conn.receive_data(frame(body))
    assert remote_error(conn.next_event).code is ErrorCode.MALFORMED_FRAME


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


NEAR_LIMIT_BODIES = {
    # Nesting that msgpack itself still parses (its limit is 1024 levels), in a
    # field of the wrong type, which the decoder then reports.
    "ack-seq": lambda depth: b"\x92\x07" + nested(depth),
    "client-hello-version": lambda depth: b"\x93\x01" + nested(depth) + b"\xa1c",
    "record-seq": lambda depth: b"\x92\x05\x91\x95" + nested(depth) + b"\x00\xc0\xc4\x00\x80",
    "error-details": lambda depth: b"\x94\x10\x01\xa1m" + nested(depth),
    "status": lambda depth: b"\x92\x0f" + nested(depth),
}


@pytest.mark.parametrize("depth", [10, 1015])
@pytest.mark.parametrize("where", list(NEAR_LIMIT_BODIES))
def test_nesting_below_msgpacks_limit_is_a_remote_protocol_error(where: str, depth: int) -> None:
    """A peer must not turn a bad field into a RecursionError (or any non-protocol error)."""
    body = NEAR_LIMIT_BODIES[where](depth)
    error = decode_error(body)
    if "hello" in where:  # "Handshake": a version that is not the integer 1
        assert error.code is ErrorCode.VERSION_MISMATCH
    else:
        assert error.code is ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "body",
    [
        b"\x92\x08\xa2\xff\xfe",  # GET_HEAD stream
        b"\x93\x01\x01\xa3a\xc3\x28",  # CLIENT_HELLO client name
        b"\x94\x10\x01\xa1\x80\x80",  # ERROR message
        b"\x92\x0f\x81\xa2\xed\xa0\x01",  # STATUS_REPORT key (an encoded surrogate)
        b"\x92\x05\x91\x95\x01\x00\xc0\xc4\x00\x81\xa1\xff\xc4\x00",  # record header name
    ],
)
def test_invalid_utf8_in_a_str_field_is_malformed(body: bytes) -> None:
    assert decode_error(body).code is ErrorCode.MALFORMED_FRAME


@FAST
@given(
    cls=st.sampled_from([ClientHello, ServerHello]),
    version=st.integers(0, 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION),
    data=st.data(),
)
def test_hello_with_another_version_is_a_version_mismatch(
    cls: type[Any], version: int, data: st.DataObject
) -> None:
    items = msgpack.unpackb(body_of(data.draw(MESSAGE_STRATEGIES[cls])))
    items[1] = version
    assert decode_error(packb(items)).code is ErrorCode.VERSION_MISMATCH
    # "the version is checked before anything else in a hello": other fields may differ.
    other = [cls.TYPE.value, version, *data.draw(st.lists(values, max_size=4))]
    assert decode_error(packb(other)).code is ErrorCode.VERSION_MISMATCH
    # And a connection reports it as such, as the first frame.
    if cls is ClientHello:
        conn: ServerConnection | ClientConnection = ServerConnection()
    else:
        conn = ClientConnection()
        conn.send(ClientHello(PROTOCOL_VERSION, "c"))
    conn.receive_data(frame(packb(items)))
    assert remote_error(conn.next_event).code is ErrorCode.VERSION_MISMATCH


@pytest.mark.parametrize(
    "hello",
    [ClientHello(PROTOCOL_VERSION, "c", "t"), ServerHello(PROTOCOL_VERSION, "p", 1, 1024, 5000)],
    ids=lambda m: m.TYPE.name,
)
@pytest.mark.parametrize("version", [1.0, True, "1", b"\x01", None, [1]], ids=repr)
def test_hello_version_equal_to_1_but_not_the_integer_is_a_mismatch(
    hello: Message, version: Any
) -> None:
    """ "Handshake": only the integer 1 passes the version check (not 1.0, not true), and
    a hello with no fields at all is malformed, not a mismatch."""
    items = msgpack.unpackb(body_of(hello))
    assert decode_message(packb(items)) == hello
    items[1] = version
    assert decode_error(packb(items)).code is ErrorCode.VERSION_MISMATCH
    assert decode_error(packb([hello.TYPE.value])).code is ErrorCode.MALFORMED_FRAME


# --- 4. Connection state machines ------------------------------------------------------


def ready_server() -> ServerConnection:
    server = ServerConnection()
    server.send(ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE))
    server.receive_data(encode(ClientHello(PROTOCOL_VERSION, "client")))
    assert server.next_event() == ClientHello(PROTOCOL_VERSION, "client")
    assert server.their_state is State.READY
    return server


# "Authentication": a token in CLIENT_HELLO, answered with AUTHENTICATED before all else.


def test_hello_without_token_is_the_frame_old_clients_send() -> None:
    old = bytes.fromhex("00000008930101a464656d6f")  # docs/protocol.md, "Worked example"
    assert encode(ClientHello(PROTOCOL_VERSION, "demo")) == old
    assert decode_message(old[4:]) == ClientHello(PROTOCOL_VERSION, "demo", None)
    with_token = decode_message(body_of(ClientHello(PROTOCOL_VERSION, "demo", "billing:ab")))
    assert with_token == ClientHello(PROTOCOL_VERSION, "demo", "billing:ab")


def test_server_answers_a_token_first_and_once() -> None:
    server = ServerConnection()
    server.send(ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE))
    with pytest.raises(LocalProtocolError, match="cannot send AUTHENTICATED while ready"):
        server.send(Authenticated("billing"))  # no token: nothing to answer
    server.receive_data(encode(ClientHello(PROTOCOL_VERSION, "c", "billing:ab")))
    server.next_event()
    with pytest.raises(LocalProtocolError, match="before anything else"):
        server.send(StreamInfo("orders", 1, 1))
    with pytest.raises(LocalProtocolError, match="cannot send RECORDS"):
        server.send_records([])
    server.send(Authenticated("billing"))
    with pytest.raises(LocalProtocolError, match="cannot send AUTHENTICATED while ready"):
        server.send(Authenticated("billing"))  # once
    server.send(StreamInfo("orders", 1, 1))
    assert ready_server().our_state is State.READY  # no token, nothing owed


def test_server_may_refuse_a_token_with_error() -> None:
    server = ServerConnection()
    server.receive_data(encode(ClientHello(PROTOCOL_VERSION, "c", "bad")))
    server.next_event()
    server.send(ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE))
    server.send(Error(int(ErrorCode.AUTHENTICATION_FAILED), "invalid token", {}))
    assert server.our_state is State.CLOSED


@pytest.mark.parametrize("token", [None, "billing:ab"])
def test_client_expects_authenticated_exactly_when_it_sent_a_token(token: str | None) -> None:
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c", token))
    client.send(GetHead("orders"))  # pipelined before the answer to the token
    hello = ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE)
    client.receive_data(encode(hello) + encode(StreamInfo("orders", 1, 1)))
    assert client.next_event() == hello
    error = remote_error(client.next_event) if token else None
    if error is not None:
        assert error.code is ErrorCode.UNEXPECTED_MESSAGE
        assert "expected AUTHENTICATED" in str(error)
        return
    client.receive_data(encode(Authenticated("billing")))
    assert client.next_event() == StreamInfo("orders", 1, 1)
    error = remote_error(client.next_event)
    assert "unexpected AUTHENTICATED while ready" in str(error)  # no token was sent


def test_client_reads_authenticated_then_responses() -> None:
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c", "billing:ab"))
    client.send(GetHead("orders"))
    hello = ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE)
    client.receive_data(
        encode(hello) + encode(Authenticated("billing")) + encode(StreamInfo("orders", 1, 1))
    )
    assert [client.next_event() for _ in range(3)] == [
        hello,
        Authenticated("billing"),
        StreamInfo("orders", 1, 1),
    ]


def ready_client(*requests: Message) -> ClientConnection:
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "client"))
    hello = ServerHello(PROTOCOL_VERSION, "producer", 1, DEFAULT_MAX_FRAME_SIZE)
    client.receive_data(encode(hello))
    assert client.next_event() == hello
    for request in requests:
        client.send(request)
    return client


def receive(conn: ServerConnection | ClientConnection, message: Message) -> Message | None:
    conn.receive_data(encode(message))
    return conn.next_event()


def rejected(conn: ServerConnection | ClientConnection, message: Message) -> RemoteProtocolError:
    return remote_error(lambda: receive(conn, message))


def recs(*seqs: int) -> Records:
    return Records(tuple(Record(seq, 0, None, b"v", {}) for seq in seqs))


NOT_CLIENT_HELLO = [
    ServerHello(PROTOCOL_VERSION, "p", 1, 1024),
    Subscribe("s", 1, "c", None),
    Subscribed("s", 1, 1),
    recs(1),
    Heartbeat(1),
    Ack(1),
    GetHead("s"),
    StreamInfo("s", 1, 1),
    GetRange("s", 1, 2),
    RangeEnd(),
    ListStreams(),
    StreamList(()),
    GetStatus(),
    StatusReport({}),
]


@pytest.mark.parametrize("first", NOT_CLIENT_HELLO, ids=lambda m: m.TYPE.name)
def test_server_needs_client_hello_first(first: Message) -> None:
    server = ServerConnection()
    assert rejected(server, first).code is ErrorCode.UNEXPECTED_MESSAGE
    # The same happens after the server sent its own hello.
    server = ServerConnection()
    server.send(ServerHello(PROTOCOL_VERSION, "p", 1, 1024))
    assert rejected(server, first).code is ErrorCode.UNEXPECTED_MESSAGE


@pytest.mark.parametrize(
    "request_",
    [
        GetHead("s"),
        GetRange("s", 1, 10),
        ListStreams(),
        GetStatus(),
        GetHistory("s", b"k", 1, 10),
        SeekTime("s", 1700000000000),
        WatchHead("s", 7),
    ],
    ids=lambda m: m.TYPE.name,
)
def test_server_accepts_requests_when_ready(request_: Message) -> None:
    server = ready_server()
    for _ in range(3):
        assert receive(server, request_) == request_
    assert server.their_state is State.READY


@pytest.mark.parametrize(
    "message",
    [
        ClientHello(PROTOCOL_VERSION, "again"),
        Ack(1),
        ServerHello(PROTOCOL_VERSION, "p", 1, 1024),
        StreamInfo("s", 1, 1),
        recs(1),
        RangeEnd(),
        Heartbeat(1),
    ],
    ids=lambda m: m.TYPE.name,
)
def test_server_rejects_non_requests_when_ready(message: Message) -> None:
    assert rejected(ready_server(), message).code is ErrorCode.UNEXPECTED_MESSAGE


@pytest.mark.parametrize(
    "message",
    [Subscribe("s", 5, "c", "p"), GetHead("s"), ListStreams(), GetStatus(), GetRange("s", 1, 2)],
    ids=lambda m: m.TYPE.name,
)
def test_server_accepts_only_acks_after_subscribe(message: Message) -> None:
    server = ready_server()
    assert receive(server, Subscribe("s", 1, "c", None)) == Subscribe("s", 1, "c", None)
    assert server.their_state is State.STREAMING
    for seq in (0, 5, 3):  # ACKs are not checked for order by the protocol layer
        assert receive(server, Ack(seq)) == Ack(seq)
    assert rejected(server, message).code is ErrorCode.UNEXPECTED_MESSAGE


def test_server_must_send_server_hello_first() -> None:
    server = ServerConnection()
    with pytest.raises(LocalProtocolError):
        server.send(StreamInfo("s", 1, 1))
    with pytest.raises(LocalProtocolError):
        server.send_records([encode_record(1, 0, None, b"v", {})])
    assert server.our_state is State.AWAIT_HELLO
    hello = ServerHello(PROTOCOL_VERSION, "p", 1, 1024)
    assert server.send(hello) == encode(hello)
    assert server.our_state is State.READY
    with pytest.raises(LocalProtocolError):
        server.send(hello)
    assert server.send_records([]) == encode(Records(()))


def test_server_sends_only_records_and_heartbeats_once_subscribed() -> None:
    """ "What the server sends": SUBSCRIBED moves the server to STREAMING, where RECORDS and
    HEARTBEAT (and ERROR) are all it may send; no HEARTBEAT outside a subscription."""
    server = ready_server()
    with pytest.raises(LocalProtocolError, match="cannot send HEARTBEAT while ready"):
        server.send(Heartbeat(0))
    receive(server, Subscribe("s", 1, "c", None))
    server.send(Subscribed("s", 0, 1))
    assert server.our_state is State.STREAMING
    assert server.send(Heartbeat(0)) == encode(Heartbeat(0))
    assert server.send_records([encode_record(1, 0, None, b"v", {})]) == encode(recs(1))
    for answer in (StreamInfo("s", 1, 1), RangeEnd(), Subscribed("s", 0, 1)):
        with pytest.raises(LocalProtocolError, match="on a subscription"):
            server.send(answer)
    server.send(Error(int(ErrorCode.SHUTTING_DOWN), "bye", {}))
    assert server.our_state is State.CLOSED


def test_server_hello_heartbeat_interval_is_optional() -> None:
    """ "Handshake": ``heartbeat_interval_ms`` is optional: a 4-field SERVER_HELLO (from a
    producer that predates it) still opens the connection, and decodes with None."""
    old = ServerHello(PROTOCOL_VERSION, "p", 1, 1024)
    assert body_of(old) == packb([2, 1, "p", 1, 1024])
    announced = ServerHello(PROTOCOL_VERSION, "p", 1, 1024, 5000)
    assert body_of(announced) == packb([2, 1, "p", 1, 1024, 5000])
    for hello in (old, announced):
        client = ClientConnection()
        client.send(ClientHello(PROTOCOL_VERSION, "c"))
        assert receive(client, hello) == hello
        assert client.their_state is State.READY
    for bad in (None, -1, 1.5, "5000"):
        assert decode_error(packb([2, 1, "p", 1, 1024, bad])).code is ErrorCode.MALFORMED_FRAME


def test_server_may_refuse_with_an_error_before_its_hello() -> None:
    server = ServerConnection()
    error = Error(int(ErrorCode.TOO_MANY_CONNECTIONS), "busy", {})
    assert server.send(error) == encode(error)
    assert server.our_state is State.CLOSED
    for message in (ServerHello(PROTOCOL_VERSION, "p", 1, 1024), error):
        with pytest.raises(LocalProtocolError):
            server.send(message)
    with pytest.raises(LocalProtocolError):
        server.send_records([])
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c"))
    assert receive(client, error) == error
    assert client.their_state is State.CLOSED


@pytest.mark.parametrize("first", NOT_CLIENT_HELLO[1:], ids=lambda m: m.TYPE.name)
def test_client_needs_server_hello_first(first: Message) -> None:
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c"))
    assert rejected(client, first).code is ErrorCode.UNEXPECTED_MESSAGE


def test_client_must_send_client_hello_first() -> None:
    client = ClientConnection()
    with pytest.raises(LocalProtocolError):
        client.send(GetHead("s"))
    client.send(ClientHello(PROTOCOL_VERSION, "c"))
    with pytest.raises(LocalProtocolError):
        client.send(ClientHello(PROTOCOL_VERSION, "c"))
    for not_a_request in (Ack(1), StreamInfo("s", 1, 1), RangeEnd(), Heartbeat(1)):
        with pytest.raises(LocalProtocolError):
            client.send(not_a_request)


@pytest.mark.parametrize(
    "response", [StreamInfo("s", 1, 1), StreamList(()), StatusReport({}), recs(1), RangeEnd()]
)
def test_client_rejects_responses_with_no_request_pending(response: Message) -> None:
    assert rejected(ready_client(), response).code is ErrorCode.UNEXPECTED_MESSAGE


@pytest.mark.parametrize(
    ("request_", "wrong"),
    [
        (GetHead("s"), StreamList(())),
        (GetHead("s"), recs(1)),
        (GetHead("s"), RangeEnd()),
        (ListStreams(), StreamInfo("s", 1, 1)),
        (GetStatus(), StreamList(())),
        (GetRange("s", 1, 5), StreamInfo("s", 1, 1)),
        (GetRange("s", 1, 5), Subscribed("s", 1, 1)),
        (GetHead("s"), Heartbeat(1)),
        (GetHead("s"), ServerHello(PROTOCOL_VERSION, "p", 1, 1024)),
        (SeekTime("s", 0), StreamInfo("s", 1, 1)),
        (GetHead("s"), TimePosition("s", 1, 1, 1)),
        (GetHistory("s", b"k", 1, 5), StreamInfo("s", 1, 1)),
        (GetHistory("s", b"k", 1, 5), TimePosition("s", 1, 1, 1)),
        (WatchHead("s", 1), TimePosition("s", 1, 1, 1)),
        (WatchHead("s", 1), recs(2)),
    ],
    ids=str,
)
def test_client_rejects_a_response_to_another_request(request_: Message, wrong: Message) -> None:
    assert rejected(ready_client(request_), wrong).code is ErrorCode.UNEXPECTED_MESSAGE


def test_client_matches_pipelined_responses_in_order() -> None:
    client = ready_client(GetHead("s"), ListStreams(), GetStatus())
    assert rejected(client, StreamList(())).code is ErrorCode.UNEXPECTED_MESSAGE
    client = ready_client(GetHead("s"), ListStreams(), GetStatus())
    for response in (StreamInfo("s", 3, 1), StreamList(()), StatusReport({"a": 1})):
        assert receive(client, response) == response
    assert rejected(client, StatusReport({})).code is ErrorCode.UNEXPECTED_MESSAGE


def test_client_get_range_accepts_records_then_range_end() -> None:
    client = ready_client(GetRange("s", 10, 20), GetHead("s"))
    for message in (recs(10, 11), recs(), recs(13, 19), RangeEnd(), StreamInfo("s", 19, 1)):
        assert receive(client, message) == message
    client = ready_client(GetRange("s", 5, 5))
    assert receive(client, RangeEnd()) == RangeEnd()
    # A second range starts from scratch.
    client = ready_client(GetRange("s", 10, 20), GetRange("s", 1, 3))
    for message in (recs(15), RangeEnd(), recs(1, 2), RangeEnd()):
        assert receive(client, message) == message


def erecs(epoch: int, *seqs: int) -> Records:
    return Records(recs(*seqs).records, epoch)


def test_range_with_epochs_is_the_frames_old_peers_send_without_them() -> None:
    """Per "Optional fields", GET_RANGE without seen_epoch and RANGE_END without its vouch are
    the frames of before epochs; with them, the bytes of docs/protocol.md's table."""
    assert encode(GetRange("s", 1, 2)) == frame(packb([MessageType.GET_RANGE.value, "s", 1, 2]))
    assert encode(RangeEnd()) == bytes.fromhex("00000002910b")
    with_epochs = bytes.fromhex("0000000c95 0a a66f7264657273 04 08 03".replace(" ", ""))
    assert encode(GetRange("orders", 4, 8, 3)) == with_epochs
    assert decode_message(with_epochs[4:]) == GetRange("orders", 4, 8, 3)
    assert encode(RangeEnd(3, 0)) == bytes.fromhex("00000004930b0300")
    assert decode_message(bytes.fromhex("930b0300")) == RangeEnd(3, 0)
    assert decode_message(bytes.fromhex("910b")) == RangeEnd(None, None)


def test_client_range_with_epochs_accepts_epochs_then_the_vouch() -> None:
    client = ready_client(GetRange("s", 10, 20, 3), GetRange("s", 1, 3, 0), GetHead("s"))
    for message in (erecs(3, 10, 11), erecs(4, 12), erecs(0, 15, 19), RangeEnd(3, 0)):
        assert receive(client, message) == message
    for message in (erecs(1, 1, 2), RangeEnd(0, 0), StreamInfo("s", 19, 1)):
        assert receive(client, message) == message
    # Seqs the client read before the range were rewritten: the vouch comes alone.
    client = ready_client(GetRange("s", 10, 20, 3), GetRange("s", 10, 10, 3))
    for message in (RangeEnd(5, 4), RangeEnd(5, 9)):
        assert receive(client, message) == message


@pytest.mark.parametrize(
    ("request_", "before", "bad"),
    [
        (GetRange("s", 10, 20, 3), (), recs(10)),  # asked for epochs: every frame has one
        (GetRange("s", 10, 20, 3), (erecs(3, 10),), recs(11)),
        (GetRange("s", 10, 20, 3), (), RangeEnd()),  # ... and the vouch
        (GetRange("s", 10, 20, 3), (), RangeEnd(3, None)),
        (GetRange("s", 10, 20, 3), (), RangeEnd(3, 10)),  # not a seq before the range
        (GetRange("s", 10, 20, 3), (), RangeEnd(3, 25)),
        (GetRange("s", 10, 20, 3), (erecs(3, 10),), RangeEnd(3, 4)),  # after records
        (GetRange("s", 1, 20, 0), (), RangeEnd(0, 1)),
        (GetRange("s", 10, 20), (), erecs(3, 10)),  # did not ask: no epochs
        (GetRange("s", 10, 20), (recs(10),), RangeEnd(3, 0)),
        (GetRange("s", 10, 20), (), RangeEnd(3, None)),
        (GetHistory("s", b"k", 10, 20), (), erecs(3, 10)),  # a history never has them
        (GetHistory("s", b"k", 10, 20), (), RangeEnd(0, 0)),
    ],
    ids=str,
)
def test_client_range_epochs_exactly_when_asked(
    request_: Message, before: tuple[Message, ...], bad: Message
) -> None:
    client = ready_client(request_)
    for message in before:
        assert receive(client, message) == message
    assert rejected(client, bad).code is ErrorCode.MALFORMED_FRAME


def test_server_sends_a_range_frame_with_its_epoch() -> None:
    server = ready_server()
    assert receive(server, GetRange("s", 4, 8, 3)) == GetRange("s", 4, 8, 3)
    built = server.send_records([encode_record(4, 0, None, b"v3", {})], 3)
    assert decode_message(built[4:]) == Records((Record(4, 0, None, b"v3", {}),), 3)
    assert server.send(RangeEnd(3, 0)) == encode(RangeEnd(3, 0))


@pytest.mark.parametrize(
    ("before", "bad"),
    [
        ((), recs(9)),  # before start
        ((), recs(9, 10)),
        ((), recs(20)),  # end is exclusive
        ((), recs(19, 20)),
        ((recs(12),), recs(11)),  # backwards across frames
        ((recs(12),), recs(12)),  # repeated
        ((recs(10, 15),), recs(14, 16)),
    ],
    ids=str,
)
def test_client_rejects_records_outside_the_range(
    before: tuple[Records, ...], bad: Records
) -> None:
    client = ready_client(GetRange("s", 10, 20))
    for message in before:
        assert receive(client, message) == message
    rejected(client, bad)


def test_client_history_accepts_records_with_gaps_within_the_range() -> None:
    client = ready_client(GetHistory("s", b"k", 10, 2**40 + 1), SeekTime("s", 5))
    for message in (recs(10, 12), recs(), recs(40, 2**40), RangeEnd(), TimePosition("s", 7, 9, 1)):
        assert receive(client, message) == message


@pytest.mark.parametrize(
    ("before", "bad"),
    [((), recs(9)), ((), recs(20)), ((recs(12),), recs(11)), ((recs(12),), recs(12))],
    ids=str,
)
def test_client_rejects_history_records_outside_the_range_or_backwards(
    before: tuple[Records, ...], bad: Records
) -> None:
    client = ready_client(GetHistory("s", b"k", 10, 20))
    for message in before:
        assert receive(client, message) == message
    rejected(client, bad)


def subscribed_client(start: int) -> ClientConnection:
    client = ready_client()
    client.send(Subscribe("s", start, "c", None))
    assert receive(client, Subscribed("s", 100, 1)) == Subscribed("s", 100, 1)
    return client


def test_client_subscription_accepts_records_going_forward() -> None:
    client = subscribed_client(5)
    for message in (recs(5, 6), Heartbeat(6), recs(), recs(9), Heartbeat(9), recs(10, 1000)):
        assert receive(client, message) == message
    assert client.last_seq == 1000
    client.send(Ack(1000))


@pytest.mark.parametrize(
    ("before", "bad"),
    [
        ((), recs(4)),  # before start_seq
        ((recs(7),), recs(7)),
        ((recs(7),), recs(6, 8)),
        ((recs(7), Heartbeat(7)), recs(3)),
    ],
    ids=str,
)
def test_client_subscription_rejects_records_going_backwards(
    before: tuple[Message, ...], bad: Records
) -> None:
    client = subscribed_client(5)
    for message in before:
        assert receive(client, message) == message
    rejected(client, bad)


@pytest.mark.parametrize(
    "wrong",
    [StreamInfo("s", 1, 1), RangeEnd(), Subscribed("s", 1, 1), StatusReport({})],
    ids=lambda m: m.TYPE.name,
)
def test_client_subscription_rejects_other_messages(wrong: Message) -> None:
    assert rejected(subscribed_client(1), wrong).code is ErrorCode.UNEXPECTED_MESSAGE


def test_client_subscription_needs_subscribed_first() -> None:
    client = ready_client()
    client.send(Subscribe("s", 1, "c", None))
    assert rejected(client, recs(1)).code is ErrorCode.UNEXPECTED_MESSAGE
    client = ready_client()
    client.send(Subscribe("s", 1, "c", None))
    assert rejected(client, Heartbeat(1)).code is ErrorCode.UNEXPECTED_MESSAGE


def test_client_sends_only_acks_after_subscribe() -> None:
    with pytest.raises(LocalProtocolError):
        ready_client(GetHead("s")).send(Subscribe("s", 1, "c", None))  # a request is pending
    client = ready_client()
    client.send(Subscribe("s", 1, "c", None))
    for message in (Subscribe("s", 1, "c", None), GetHead("s"), ListStreams()):
        with pytest.raises(LocalProtocolError):
            client.send(message)
    assert client.send(Ack(3)) == encode(Ack(3))


def hello_sent_client() -> ClientConnection:
    client = ClientConnection()
    client.send(ClientHello(PROTOCOL_VERSION, "c"))
    return client


def subscribing_client() -> ClientConnection:
    client = ready_client()
    client.send(Subscribe("s", 1, "c", None))
    return client


ERROR = Error(int(ErrorCode.SHUTTING_DOWN), "bye", {"why": "test"})
CLIENT_STATES: dict[str, Callable[[], ClientConnection]] = {
    "before-hello": ClientConnection,
    "hello-sent": hello_sent_client,
    "ready": ready_client,
    "range-pending": lambda: ready_client(GetRange("s", 1, 5)),
    "subscribing": subscribing_client,
    "subscribed": lambda: subscribed_client(1),
}


@pytest.mark.parametrize("state", list(CLIENT_STATES))
def test_client_accepts_an_error_at_any_time(state: str) -> None:
    client = CLIENT_STATES[state]()
    client.receive_data(encode(ERROR) + encode(StreamInfo("s", 1, 1)))
    assert client.next_event() == ERROR
    assert client.their_state is State.CLOSED
    assert client.next_event() is None  # nothing after the last frame


SERVER_STATES: dict[str, Callable[[], ServerConnection]] = {
    "before-hello": ServerConnection,
    "ready": ready_server,
    "streaming": lambda: streaming_server(),
}


def streaming_server() -> ServerConnection:
    server = ready_server()
    assert receive(server, Subscribe("s", 1, "c", None)) == Subscribe("s", 1, "c", None)
    return server


@pytest.mark.parametrize("state", list(SERVER_STATES))
def test_server_accepts_an_error_at_any_time(state: str) -> None:
    server = SERVER_STATES[state]()
    server.receive_data(encode(ERROR) + encode(GetHead("s")))
    assert server.next_event() == ERROR
    assert server.their_state is State.CLOSED
    assert server.next_event() is None


@pytest.mark.parametrize("state", list(CLIENT_STATES))
def test_client_cannot_send_after_sending_an_error(state: str) -> None:
    client = CLIENT_STATES[state]()
    assert client.send(ERROR) == encode(ERROR)
    assert client.our_state is State.CLOSED
    for message in (Ack(1), GetHead("s"), ERROR):
        with pytest.raises(LocalProtocolError):
            client.send(message)


@pytest.mark.parametrize(
    ("state", "in_flight"),
    [
        ("range-pending", (recs(1, 2), recs(4), RangeEnd())),
        ("subscribing", (Subscribed("s", 9, 1), recs(1, 2), Heartbeat(2))),
        ("subscribed", (recs(1, 2), Heartbeat(2), recs(3))),
    ],
)
def test_client_reads_frames_in_flight_after_sending_an_error(
    state: str, in_flight: tuple[Message, ...]
) -> None:
    """Sending ERROR closes our side only: valid frames the producer sent before it
    read our ERROR come out as sent (or are ignored), never as an error or a crash."""
    client = CLIENT_STATES[state]()
    client.send(ERROR)
    client.receive_data(b"".join(map(encode, in_flight)))
    received = []
    while (event := client.next_event()) is not None:
        received.append(event)
    assert received == list(in_flight)[: len(received)]


@pytest.mark.parametrize("state", ["ready", "range-pending", "subscribed"])
def test_client_cannot_send_after_receiving_an_error(state: str) -> None:
    """ERROR is "the last frame on a connection": nothing may be sent after it."""
    client = CLIENT_STATES[state]()
    assert receive(client, ERROR) == ERROR
    message = Ack(1) if state == "subscribed" else GetHead("s")
    with pytest.raises(LocalProtocolError):
        client.send(message)


def test_server_cannot_send_after_receiving_an_error() -> None:
    server = ready_server()
    assert receive(server, ERROR) == ERROR
    with pytest.raises(LocalProtocolError):
        server.send(StreamInfo("s", 1, 1))


# --- The connected pair ----------------------------------------------------------------


class Pipe:
    """Bytes one side sent and the other has not read yet, with what they should decode to."""

    def __init__(self, receiver: ServerConnection | ClientConnection) -> None:
        self.receiver = receiver
        self.pending = bytearray()
        self.expected: deque[Message] = deque()
        self.delivered = 0

    def deliver(self, data: st.DataObject, everything: bool = False) -> None:
        count = len(self.pending)
        if not everything:
            count = data.draw(st.integers(0, count), label="bytes delivered")
        blob = bytes(self.pending[:count])
        del self.pending[:count]
        for chunk in split(data, blob):
            self.receiver.receive_data(chunk)
            while (event := self.receiver.next_event()) is not None:
                assert self.expected, f"unexpected extra event {event!r}"
                assert event == self.expected.popleft()
                self.delivered += 1


@st.composite
def range_responses(draw: st.DrawFn, request: GetRange) -> list[tuple[Message, bool]]:
    """RECORDS frames covering part of [start, end), in order, then RANGE_END; with epochs
    ("Epochs"), frames carrying one and RANGE_END's vouch, or that vouch alone.

    The flag says whether the server sends the frame with ``send_records``.
    """
    epochs = request.seen_epoch is not None
    if epochs and request.start > 1 and draw(st.booleans(), label="rewritten"):
        rewritten = draw(st.integers(1, request.start - 1), label="rewritten_from")
        return [(RangeEnd(draw(uints), rewritten), False)]
    seqs: list[int] = []
    if request.end > request.start:
        seqs = sorted(draw(st.sets(st.integers(request.start, request.end - 1), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(seqs)), max_size=4)))
    pieces = [seqs[a:b] for a, b in itertools.pairwise([0, *cuts, len(seqs)])]
    responses: list[tuple[Message, bool]] = [
        (Records(draw(records_at(piece)), draw(uints) if epochs else None), draw(st.booleans()))
        for piece in pieces
    ]
    return [*responses, (RangeEnd(draw(uints), 0) if epochs else RangeEnd(), False)]


def responses_to(data: st.DataObject, request: Message) -> Iterator[tuple[Message, bool]]:
    if isinstance(request, GetHead | ReportPosition | WatchHead):
        yield StreamInfo(request.stream, data.draw(uints), data.draw(uints)), False
    elif isinstance(request, SeekTime):
        yield TimePosition(request.stream, *data.draw(st.tuples(uints, uints, uints))), False
    elif isinstance(request, GetHistory):
        yield from data.draw(range_responses(GetRange(request.stream, request.start, request.end)))
    elif isinstance(request, ListStreams):
        yield data.draw(MESSAGE_STRATEGIES[StreamList]), False
    elif isinstance(request, GetStatus):
        yield data.draw(MESSAGE_STRATEGIES[StatusReport]), False
    else:
        assert isinstance(request, GetRange)
        yield from data.draw(range_responses(request))


pair_requests = st.one_of(
    MESSAGE_STRATEGIES[GetHead],
    st.builds(
        lambda stream, start, length, seen: GetRange(stream, start, start + length, seen),
        texts,
        st.integers(1, MAX_SEQ - 64),
        st.integers(0, 40),
        st.none() | uints,
    ),
    MESSAGE_STRATEGIES[ListStreams],
    MESSAGE_STRATEGIES[GetStatus],
    MESSAGE_STRATEGIES[ReportPosition],
    MESSAGE_STRATEGIES[SeekTime],
    MESSAGE_STRATEGIES[WatchHead],
    st.builds(
        lambda stream, key, start, length: GetHistory(stream, key, start, start + length),
        texts,
        st.binary(max_size=4),
        st.integers(1, MAX_SEQ - 64),
        st.integers(0, 40),
    ),
)


@THOROUGH
@given(data=st.data())
def test_connected_pair_delivers_every_message_as_sent(data: st.DataObject) -> None:
    client, server = ClientConnection(), ServerConnection()
    to_server, to_client = Pipe(server), Pipe(client)

    def client_sends(message: Message) -> None:
        to_server.pending += client.send(message)
        to_server.expected.append(message)

    def server_sends(message: Message, raw: bool = False) -> None:
        if raw:
            assert isinstance(message, Records)
            records = [encode_record(*r) for r in message.records]
            to_client.pending += server.send_records(records, message.epoch)
        else:
            to_client.pending += server.send(message)
        to_client.expected.append(message)

    def some_traffic() -> None:
        to_server.deliver(data)
        to_client.deliver(data)

    def maybe_error() -> bool:
        """Sometimes one side ends the conversation with an ERROR frame."""
        if data.draw(st.integers(0, 9), label="error?") != 0:
            return False
        error = data.draw(MESSAGE_STRATEGIES[Error], label="error")
        sender, pipe = data.draw(
            st.sampled_from([(client, to_server), (server, to_client)]), label="who errs"
        )
        if sender is client:
            client_sends(error)
        else:
            server_sends(error)
        assert sender.our_state is State.CLOSED
        with pytest.raises(LocalProtocolError):
            sender.send(Ack(1) if sender is client else Heartbeat(1))
        # Frames in flight towards the side that sent ERROR may be read as sent or
        # ignored, but never turned into an error; the ERROR itself always arrives.
        to_server.deliver(data, everything=True)
        to_client.deliver(data, everything=True)
        assert not pipe.expected
        assert pipe.receiver.their_state is State.CLOSED
        pipe.receiver.receive_data(encode(Heartbeat(1)) + encode(Ack(1)))
        assert pipe.receiver.next_event() is None  # nothing is read after an ERROR
        return True

    client_hello = data.draw(MESSAGE_STRATEGIES[ClientHello], label="client hello")
    server_hello = data.draw(MESSAGE_STRATEGIES[ServerHello], label="server hello")
    if data.draw(st.booleans(), label="server speaks first"):
        server_sends(server_hello)
        some_traffic()
        client_sends(client_hello)
    else:
        client_sends(client_hello)
        some_traffic()
        server_sends(server_hello)
    if client_hello.token is not None:
        # "Authentication": the server answers a token, once it has read it, before all else.
        to_server.deliver(data, everything=True)
        server_sends(data.draw(MESSAGE_STRATEGIES[Authenticated], label="authenticated"))
    some_traffic()
    if maybe_error():
        return

    # Requests, pipelined: the server answers the oldest one, piece by piece.
    outstanding: deque[Iterator[tuple[Message, bool]]] = deque()
    for _ in range(data.draw(st.integers(0, 12), label="request steps")):
        if len(outstanding) > 0 and data.draw(st.booleans(), label="respond"):
            response = next(outstanding[0], None)
            if response is None:
                outstanding.popleft()
            else:
                server_sends(*response)
        else:
            request = data.draw(pair_requests, label="request")
            client_sends(request)
            outstanding.append(responses_to(data, request))
        some_traffic()
        if maybe_error():
            return
    while outstanding:
        for response in outstanding.popleft():
            server_sends(*response)
            some_traffic()
    to_server.deliver(data, everything=True)
    to_client.deliver(data, everything=True)
    assert client.our_state is State.READY
    assert server.their_state is State.READY

    if data.draw(st.booleans(), label="subscribe"):
        start = data.draw(st.integers(1, 2**40), label="start seq")
        client_sends(data.draw(st.builds(Subscribe, texts, st.just(start), texts, texts)))
        some_traffic()
        server_sends(data.draw(MESSAGE_STRATEGIES[Subscribed]))
        some_traffic()
        last = start - 1
        for _ in range(data.draw(st.integers(0, 10), label="subscription steps")):
            step = data.draw(st.sampled_from(["records", "heartbeat", "ack"]), label="step")
            if step == "records":
                gaps = data.draw(st.lists(st.integers(1, 1000), max_size=6), label="gaps")
                seqs = [last + total for total in itertools.accumulate(gaps)]
                last = seqs[-1] if seqs else last
                raw = data.draw(st.booleans(), label="raw")
                server_sends(Records(data.draw(records_at(seqs))), raw=raw)
            elif step == "heartbeat":
                server_sends(Heartbeat(data.draw(uints)))
            else:
                client_sends(Ack(data.draw(uints)))
            some_traffic()
            if maybe_error():
                return

    to_server.deliver(data, everything=True)
    to_client.deliver(data, everything=True)
    if client.our_state is State.STREAMING:
        assert server.their_state is State.STREAMING
        assert client.their_state is State.STREAMING  # SUBSCRIBED arrived
    assert not to_server.expected
    assert not to_client.expected
    assert client.buffered == 0
    assert server.buffered == 0
    assert to_server.delivered >= 1
    assert to_client.delivered >= 1


@pytest.mark.parametrize("raw_records", [False, True])
def test_decoding_a_large_frame_leaves_the_garbage_collector_as_it_found_it(
    raw_records: bool,
) -> None:
    """Large bodies decode with the collector paused (``collector_paused``): on again after
    a good frame and after a malformed one, and still off if the caller had turned it off."""
    records = [encode_record(seq, 1000, None, b"v" * 100, {}) for seq in range(1, 1001)]
    body = records_frame(records)[FRAME_HEADER.size :]
    broken = body[:-50]  # large, and cut short in its last record
    assert len(broken) > 16 * 1024
    decoded = decode_message(body, raw_records=raw_records)
    assert isinstance(decoded, RecordRows if raw_records else Records)
    assert gc.isenabled()
    with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
        decode_message(broken, raw_records=raw_records)
    assert gc.isenabled()
    gc.disable()
    try:
        decode_message(body, raw_records=raw_records)
        assert not gc.isenabled()
    finally:
        gc.enable()
