"""streamq: each producer owns its stream, in its own SQLite database.

Publishing is part of the producer's own transaction (``Producer.transaction``, or
``streamq.publish`` on the application's own connection, ORM session included); an embedded server
pushes committed records over TCP; consumers store their position in their
own database, in the same transaction as their effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time each is imported at first use
    from .applying import save_position, save_position_async
    from .batches import Batch
    from .blocking import BlockingSQL
    from .capturing import decode_change
    from .client import Client, history
    from .compaction import Compacted
    from .consumer import Consumer
    from .errors import (
        AlreadyServedError,
        AuthenticationFailedError,
        CaptureError,
        ConcurrentWriterError,
        ConnectionLostError,
        ConsumerPositionError,
        DatabaseOpenError,
        GroupSpecError,
        LeaseLostError,
        LocalProtocolError,
        NotAuthorizedError,
        NotInTransactionError,
        OffsetOutOfRangeError,
        OutOfOrderBatchError,
        ProducerChangedError,
        ProducerMismatchError,
        ProtocolError,
        RecordFailedError,
        RecordTooLargeError,
        RemoteProtocolError,
        SchemaMissingError,
        SeqsReusedError,
        ServerError,
        SharesChangedError,
        StreamQError,
        TLSError,
        TransactionClosedError,
        UnknownStreamError,
        UnsupportedConnectionError,
        VersionMismatchError,
    )
    from .failures import DeadLetter, Retry, Stop
    from .fanin import FanInConsumer
    from .filters import Filter, share_of
    from .group import GroupConsumer
    from .metrics import ConsumerCollector
    from .positions import ConsumerLag
    from .positionstore import ConsumerTransaction, ParkedRecord
    from .producer import Producer
    from .protocol import PROTOCOL_VERSION, Record, StreamInfo, TimePosition
    from .publishing import create_tables, publish, publish_async, publish_many
    from .records import Receipt
    from .retention import RetentionPolicy, Truncation
    from .security import ClientTLS, ServerTLS, TokenAuth, make_token
    from .server import ServerSettings
    from .settings import ConsumerSettings
    from .stores import list_dead_letters, mark_for_retry
    from .sync import SyncProducer, SyncTransaction
    from .transactions import BlockingTransaction, Transaction

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "AlreadyServedError",
    "AuthenticationFailedError",
    "Batch",
    "BlockingSQL",
    "BlockingTransaction",
    "CaptureError",
    "Client",
    "ClientTLS",
    "Compacted",
    "ConcurrentWriterError",
    "ConnectionLostError",
    "Consumer",
    "ConsumerCollector",
    "ConsumerLag",
    "ConsumerPositionError",
    "ConsumerSettings",
    "ConsumerTransaction",
    "DatabaseOpenError",
    "DeadLetter",
    "FanInConsumer",
    "Filter",
    "GroupConsumer",
    "GroupSpecError",
    "LeaseLostError",
    "LocalProtocolError",
    "NotAuthorizedError",
    "NotInTransactionError",
    "OffsetOutOfRangeError",
    "OutOfOrderBatchError",
    "ParkedRecord",
    "Producer",
    "ProducerChangedError",
    "ProducerMismatchError",
    "ProtocolError",
    "Receipt",
    "Record",
    "RecordFailedError",
    "RecordTooLargeError",
    "RemoteProtocolError",
    "RetentionPolicy",
    "Retry",
    "SchemaMissingError",
    "SeqsReusedError",
    "ServerError",
    "ServerSettings",
    "ServerTLS",
    "SharesChangedError",
    "Stop",
    "StreamInfo",
    "StreamQError",
    "SyncProducer",
    "SyncTransaction",
    "TLSError",
    "TimePosition",
    "TokenAuth",
    "Transaction",
    "TransactionClosedError",
    "Truncation",
    "UnknownStreamError",
    "UnsupportedConnectionError",
    "VersionMismatchError",
    "create_tables",
    "decode_change",
    "history",
    "list_dead_letters",
    "make_token",
    "mark_for_retry",
    "publish",
    "publish_async",
    "publish_many",
    "save_position",
    "save_position_async",
    "share_of",
]

# The module of each name in __all__, imported at its first use (PEP 562): a process that
# needs only the client (the Spark source's runner and workers, started for every query)
# does not pay for the producer, the consumer and the metrics.
_MODULES = {
    "applying": ("save_position", "save_position_async"),
    "batches": ("Batch",),
    "blocking": ("BlockingSQL",),
    "capturing": ("decode_change",),
    "client": ("Client", "history"),
    "compaction": ("Compacted",),
    "consumer": ("Consumer",),
    "errors": (
        "AlreadyServedError",
        "AuthenticationFailedError",
        "CaptureError",
        "ConcurrentWriterError",
        "ConnectionLostError",
        "ConsumerPositionError",
        "DatabaseOpenError",
        "GroupSpecError",
        "LeaseLostError",
        "LocalProtocolError",
        "NotAuthorizedError",
        "NotInTransactionError",
        "OffsetOutOfRangeError",
        "OutOfOrderBatchError",
        "ProducerChangedError",
        "ProducerMismatchError",
        "ProtocolError",
        "RecordFailedError",
        "RecordTooLargeError",
        "RemoteProtocolError",
        "SchemaMissingError",
        "SeqsReusedError",
        "ServerError",
        "SharesChangedError",
        "StreamQError",
        "TLSError",
        "TransactionClosedError",
        "UnknownStreamError",
        "UnsupportedConnectionError",
        "VersionMismatchError",
    ),
    "failures": ("DeadLetter", "Retry", "Stop"),
    "fanin": ("FanInConsumer",),
    "filters": ("Filter", "share_of"),
    "group": ("GroupConsumer",),
    "metrics": ("ConsumerCollector",),
    "positions": ("ConsumerLag",),
    "positionstore": ("ConsumerTransaction", "ParkedRecord"),
    "producer": ("Producer",),
    "protocol": ("PROTOCOL_VERSION", "Record", "StreamInfo", "TimePosition"),
    "publishing": ("create_tables", "publish", "publish_async", "publish_many"),
    "records": ("Receipt",),
    "retention": ("RetentionPolicy", "Truncation"),
    "security": ("ClientTLS", "ServerTLS", "TokenAuth", "make_token"),
    "server": ("ServerSettings",),
    "settings": ("ConsumerSettings",),
    "stores": ("list_dead_letters", "mark_for_retry"),
    "sync": ("SyncProducer", "SyncTransaction"),
    "transactions": ("BlockingTransaction", "Transaction"),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # found at once from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
