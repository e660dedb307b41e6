"""streamq: each producer owns its stream, in its own SQLite database.

Publishing is part of the producer's own transaction; an embedded server
pushes committed records over TCP; consumers store their position in their
own database, in the same transaction as their effects.
"""

from .client import Client
from .consumer import Batch, Consumer, ConsumerTransaction
from .errors import (
    ConcurrentWriterError,
    ConnectionLostError,
    ConsumerPositionError,
    LocalProtocolError,
    OffsetOutOfRangeError,
    OutOfOrderBatchError,
    ProducerChangedError,
    ProducerMismatchError,
    ProtocolError,
    RecordTooLargeError,
    RemoteProtocolError,
    SeqsReusedError,
    ServerError,
    StreamQError,
    TransactionClosedError,
    UnknownStreamError,
    VersionMismatchError,
)
from .producer import Producer, Transaction
from .protocol import PROTOCOL_VERSION, Record, StreamInfo
from .server import ServerSettings
from .sync import SyncProducer, SyncTransaction

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "Batch",
    "Client",
    "ConcurrentWriterError",
    "ConnectionLostError",
    "Consumer",
    "ConsumerPositionError",
    "ConsumerTransaction",
    "LocalProtocolError",
    "OffsetOutOfRangeError",
    "OutOfOrderBatchError",
    "Producer",
    "ProducerChangedError",
    "ProducerMismatchError",
    "ProtocolError",
    "Record",
    "RecordTooLargeError",
    "RemoteProtocolError",
    "SeqsReusedError",
    "ServerError",
    "ServerSettings",
    "StreamInfo",
    "StreamQError",
    "SyncProducer",
    "SyncTransaction",
    "Transaction",
    "TransactionClosedError",
    "UnknownStreamError",
    "VersionMismatchError",
]
