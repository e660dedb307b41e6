"""streamq: each producer owns its stream, in its own SQLite database.

Publishing is part of the producer's own transaction (``Producer.transaction``, or
``streamq.publish`` on the application's own connection, ORM session included); an embedded server
pushes committed records over TCP; consumers store their position in their
own database, in the same transaction as their effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import native

native.build()  # the compiled modules or pure Python, decided before any other is imported

if TYPE_CHECKING:  # what type checkers see; at run time each is imported at first use
    from .captured import decode_change
    from .consumer.batch import Batch
    from .consumer.consumer import Consumer
    from .consumer.database import list_dead_letters, mark_for_retry
    from .consumer.failures import DeadLetter, Retry, Stop
    from .consumer.fanin import FanInConsumer
    from .consumer.position_store import ConsumerTransaction, ParkedRecord
    from .consumer.save_position import save_position, save_position_async
    from .consumer.settings import ConsumerSettings
    from .errors import (
        AlreadyServedError,
        AuthenticationFailedError,
        CaptureError,
        ConcurrentWriterError,
        ConnectionLostError,
        ConsumerPositionError,
        DatabaseOpenError,
        DatabaseUnavailableError,
        GroupSpecError,
        LeaseLostError,
        LocalProtocolError,
        NewConsumerNameError,
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
    from .filters import Filter, share_of
    from .groups.group_consumer import GroupConsumer
    from .metrics import ConsumerCollector
    from .producer.compaction import Compacted
    from .producer.consumer_positions import ConsumerLag
    from .producer.producer import Producer
    from .producer.publishing import (
        create_tables,
        create_tables_async,
        publish,
        publish_async,
        publish_many,
        publish_many_async,
    )
    from .producer.retention import RetentionPolicy, Truncation
    from .producer.server import ServerSettings
    from .producer.transactions import BlockingTransaction, Transaction
    from .protocol import PROTOCOL_VERSION, Record, StreamInfo, TimePosition
    from .records import Receipt
    from .sql import BlockingSQL
    from .sync import SyncProducer, SyncTransaction
    from .wire.client import Client, history
    from .wire.security import ClientTLS, ServerTLS, TokenAuth, make_token

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
    "DatabaseUnavailableError",
    "DeadLetter",
    "FanInConsumer",
    "Filter",
    "GroupConsumer",
    "GroupSpecError",
    "LeaseLostError",
    "LocalProtocolError",
    "NewConsumerNameError",
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
    "create_tables_async",
    "decode_change",
    "history",
    "list_dead_letters",
    "make_token",
    "mark_for_retry",
    "publish",
    "publish_async",
    "publish_many",
    "publish_many_async",
    "save_position",
    "save_position_async",
    "share_of",
]

# The module of each name in __all__, imported at its first use (PEP 562): a process that
# needs only the client (the Spark source's runner and workers, started for every query)
# does not pay for the producer, the consumer and the metrics.
_MODULES = {
    "captured": ("decode_change",),
    "consumer.batch": ("Batch",),
    "consumer.consumer": ("Consumer",),
    "consumer.database": ("list_dead_letters", "mark_for_retry"),
    "consumer.failures": ("DeadLetter", "Retry", "Stop"),
    "consumer.fanin": ("FanInConsumer",),
    "consumer.position_store": ("ConsumerTransaction", "ParkedRecord"),
    "consumer.save_position": ("save_position", "save_position_async"),
    "consumer.settings": ("ConsumerSettings",),
    "errors": (
        "AlreadyServedError",
        "AuthenticationFailedError",
        "CaptureError",
        "ConcurrentWriterError",
        "ConnectionLostError",
        "ConsumerPositionError",
        "DatabaseOpenError",
        "DatabaseUnavailableError",
        "GroupSpecError",
        "LeaseLostError",
        "LocalProtocolError",
        "NewConsumerNameError",
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
    "filters": ("Filter", "share_of"),
    "groups.group_consumer": ("GroupConsumer",),
    "metrics": ("ConsumerCollector",),
    "producer.compaction": ("Compacted",),
    "producer.consumer_positions": ("ConsumerLag",),
    "producer.producer": ("Producer",),
    "producer.publishing": (
        "create_tables",
        "create_tables_async",
        "publish",
        "publish_async",
        "publish_many",
        "publish_many_async",
    ),
    "producer.retention": ("RetentionPolicy", "Truncation"),
    "producer.server": ("ServerSettings",),
    "producer.transactions": ("BlockingTransaction", "Transaction"),
    "protocol": ("PROTOCOL_VERSION", "Record", "StreamInfo", "TimePosition"),
    "records": ("Receipt",),
    "sql": ("BlockingSQL",),
    "sync": ("SyncProducer", "SyncTransaction"),
    "wire.client": ("Client", "history"),
    "wire.security": ("ClientTLS", "ServerTLS", "TokenAuth", "make_token"),
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
