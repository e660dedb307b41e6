"""The streamq wire protocol, sans-IO: frames, messages and connection state.

Bytes in, events out; events in, bytes out. Nothing here touches a socket, an
event loop or a database: the asyncio server, the asyncio consumer and the
blocking client all drive this one package, and the tests drive it with no I/O
at all. The format is specified in ``docs/protocol.md``; section names quoted
in comments refer to it.

A connection is driven like h11::

    conn = ServerConnection()
    out = conn.send(ServerHello(...))      # bytes to write
    conn.receive_data(data)                # bytes read from the peer
    while (event := conn.next_event()) is not None:
        ...                                # a message, checked for order

Three modules, each readable alone, as h11 splits its own:

- ``events``: the messages as frozen dataclasses, each registering its fields'
  checks once;
- ``codec``: framing, msgpack, records as stored, the incremental frame decoder;
- ``state``: the connection states as one transition table, and the two
  connection classes that drive the codec through it.

This module is their one facade: every name the rest of streamq, the tests and the
documentation use as ``streamq.protocol.X``.

May import: ``errors`` and ``filters`` at the top (the error codes a frame carries, the
filters a request names), nothing else of streamq, and no I/O (``tests/test_layering.py``).
"""

from .codec import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER,
    FRAME_OVERHEAD,
    MAX_ACCEPTED_FRAME_SIZE,
    SEQ_GROWTH,
    UNNUMBERED_PREFIX,
    FrameDecoder,
    collector_paused,
    decode_message,
    decode_record,
    encode,
    encode_record,
    encode_values,
    frame,
    numbered,
    numbered_records,
    numbered_run,
    record_key,
    records_frame,
    slice_records,
    split_records,
)
from .events import (
    MAX_SEQ,
    PROTOCOL_VERSION,
    RECORDS_MESSAGES,
    Ack,
    Authenticated,
    Check,
    ClientHello,
    ColumnBuffers,
    Error,
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
    RecordColumns,
    RecordRows,
    Records,
    RecordsMessage,
    ReportPosition,
    Request,
    SeekTime,
    ServerHello,
    StatusReport,
    StreamInfo,
    StreamList,
    Subscribe,
    Subscribed,
    TimePosition,
    WatchHead,
    first_and_last_seq,
)
from .state import ClientConnection, Role, ServerConnection, State, lost_seqs
from .state import Connection as Connection  # what ``transport.read_message`` reads from

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FRAME_HEADER",
    "FRAME_OVERHEAD",
    "MAX_ACCEPTED_FRAME_SIZE",
    "MAX_SEQ",
    "PROTOCOL_VERSION",
    "RECORDS_MESSAGES",
    "SEQ_GROWTH",
    "UNNUMBERED_PREFIX",
    "Ack",
    "Authenticated",
    "Check",
    "ClientConnection",
    "ClientHello",
    "ColumnBuffers",
    "Error",
    "FrameDecoder",
    "GetHead",
    "GetHistory",
    "GetRange",
    "GetStatus",
    "Heartbeat",
    "ListStreams",
    "Message",
    "MessageType",
    "RangeEnd",
    "Record",
    "RecordColumns",
    "RecordRows",
    "Records",
    "RecordsMessage",
    "ReportPosition",
    "Request",
    "Role",
    "SeekTime",
    "ServerConnection",
    "ServerHello",
    "State",
    "StatusReport",
    "StreamInfo",
    "StreamList",
    "Subscribe",
    "Subscribed",
    "TimePosition",
    "WatchHead",
    "collector_paused",
    "decode_message",
    "decode_record",
    "encode",
    "encode_record",
    "encode_values",
    "first_and_last_seq",
    "frame",
    "lost_seqs",
    "numbered",
    "numbered_records",
    "numbered_run",
    "record_key",
    "records_frame",
    "slice_records",
    "split_records",
]
