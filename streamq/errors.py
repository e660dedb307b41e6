"""Every exception streamq raises, in one tree.

Errors say who caused them: your own code (``LocalProtocolError``,
``TransactionClosedError``), the peer (``RemoteProtocolError``), or the producer,
which answered with an error frame (``ServerError`` and its subclasses)::

    StreamQError
    ├── ProtocolError
    │   ├── LocalProtocolError        this side misused the protocol
    │   └── RemoteProtocolError       the peer sent a bad frame (has .code)
    ├── ServerError                   the producer answered with an ERROR frame
    │   ├── VersionMismatchError
    │   ├── UnknownStreamError
    │   ├── OffsetOutOfRangeError     a seq beyond the head or already deleted
    │   ├── ProducerMismatchError     the producer has another id than expected
    │   ├── TooManyConnectionsError
    │   ├── AuthenticationFailedError no token, or a token the producer did not issue
    │   ├── NotAuthorizedError        a stream (or the status) this consumer may not read
    │   └── ...                       one class per wire error code
    ├── ConsumerPositionError         the producer is behind what was already applied
    │   ├── ProducerChangedError      another producer (database) than before
    │   └── SeqsReusedError           the producer lost commits and reused their seqs
    ├── OutOfOrderBatchError          a batch applied twice or out of turn
    ├── RecordFailedError             a record whose apply kept failing (Retry gave up)
    ├── ConnectionLostError           the TCP connection failed (cause chained)
    ├── TLSError                      the TLS handshake failed; the message says why
    ├── TransactionClosedError        a transaction used after it ended
    ├── NotInTransactionError         publish on a connection outside a transaction
    ├── UnsupportedConnectionError    publish through an object it cannot write through
    ├── SchemaMissingError            a database without the log tables
    ├── DatabaseOpenError             a file that cannot be opened or is no database
    ├── DatabaseUnavailableError      a consumer's database unusable past db_reconnect_timeout
    ├── AlreadyServedError            a second process serving one producer database
    ├── ConcurrentWriterError         the log written by something outside streamq
    └── RecordTooLargeError           a record that cannot fit in one frame

Wire error codes map to classes through ``ERROR_CLASSES``, so a client turns an
ERROR frame into the matching exception with ``error_from_frame``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ErrorCode(IntEnum):
    """Error codes carried by ERROR frames (docs/protocol.md, "Errors")."""

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNEXPECTED_MESSAGE = 3
    VERSION_MISMATCH = 4
    UNKNOWN_STREAM = 5
    OFFSET_OUT_OF_RANGE = 6
    PRODUCER_MISMATCH = 7
    TOO_MANY_CONNECTIONS = 8
    IDLE_TIMEOUT = 9
    SHUTTING_DOWN = 10
    INTERNAL_ERROR = 11
    AUTHENTICATION_FAILED = 26
    NOT_AUTHORIZED = 27


class StreamQError(Exception):
    """Base class of every streamq error."""


class ProtocolError(StreamQError):
    """The protocol was violated; ``code`` is the wire error code to report."""

    code: ErrorCode = ErrorCode.UNEXPECTED_MESSAGE

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow now."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a malformed frame or a message out of order."""


# The exception class of each wire error code: every ``ServerError`` subclass that sets
# ``code`` registers itself here ("Errors": one code, one class).
ERROR_CLASSES: dict[ErrorCode, type[ServerError]] = {}


class ServerError(StreamQError):
    """The producer answered a request with an ERROR frame."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details: dict[str, Any] = details or {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            if cls.code in ERROR_CLASSES:
                raise TypeError(f"{cls.code.name} has a class already: {ERROR_CLASSES[cls.code]}")
            ERROR_CLASSES[cls.code] = cls


class MalformedFrameError(ServerError):
    code = ErrorCode.MALFORMED_FRAME


class FrameTooLargeError(ServerError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnexpectedMessageError(ServerError):
    code = ErrorCode.UNEXPECTED_MESSAGE


class VersionMismatchError(ServerError):
    """The peer speaks another protocol version ("Handshake")."""

    code = ErrorCode.VERSION_MISMATCH


class UnknownStreamError(ServerError):
    """The producer has no stream of that name (``details["stream"]``)."""

    code = ErrorCode.UNKNOWN_STREAM


class OffsetOutOfRangeError(ServerError):
    """A seq outside what the stream holds: ``details`` has ``low`` and ``head``."""

    code = ErrorCode.OFFSET_OUT_OF_RANGE


class ProducerMismatchError(ServerError):
    """The producer at that address is not the one the request named (``producer_id``)."""

    code = ErrorCode.PRODUCER_MISMATCH


class TooManyConnectionsError(ServerError):
    code = ErrorCode.TOO_MANY_CONNECTIONS


class IdleTimeoutError(ServerError):
    code = ErrorCode.IDLE_TIMEOUT


class ShuttingDownError(ServerError):
    code = ErrorCode.SHUTTING_DOWN


class InternalServerError(ServerError):
    code = ErrorCode.INTERNAL_ERROR


class AuthenticationFailedError(ServerError):
    """The producer requires a token and got none, or one it did not issue."""

    code = ErrorCode.AUTHENTICATION_FAILED


class NotAuthorizedError(ServerError):
    """The authenticated consumer asked for a stream (or the status) outside its grants."""

    code = ErrorCode.NOT_AUTHORIZED


def error_from_frame(code: int, message: str, details: dict[str, Any]) -> ServerError:
    """The exception matching an ERROR frame; unknown codes give ``ServerError``."""
    try:
        cls = ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        return ServerError(f"[code {code}] {message}", details)
    return cls(message, details)


class ConsumerPositionError(StreamQError):
    """The producer's log ends before what this consumer already applied.

    Raised instead of silently skipping or re-applying records when a producer
    database was restored from an older copy or replaced. ``lost`` is the seqs this
    consumer has that the producer's log no longer holds, when known.
    """

    def __init__(self, message: str, lost: range | None = None) -> None:
        super().__init__(message)
        self.lost = lost


class SeqsReusedError(ConsumerPositionError):
    """The producer lost commits whose records this consumer had (a power loss with
    ``durability="normal"``) and has since written other records under those seqs.

    Told apart from an intact log by the epoch that wrote the consumer's last seq
    (docs/protocol.md, "Epochs"); ``lost`` names the seqs.
    """


class ProducerChangedError(ConsumerPositionError):
    """The producer reached is not one this consumer name has applied from, and the name
    has positions from another (at this address: the database was replaced): applying
    its records too would mix two logs. ``Consumer(allow_new_producer=True)`` opts in."""


class NewConsumerNameError(ConsumerPositionError):
    """A consumer name with no position yet for a producer's stream, on a database that
    holds other names' positions for it: a misspelt name would apply the stream a second
    time from the start. Giving ``start_seq`` (or ``start_time``) starts it on purpose.
    ``stored`` maps each other name to its seq."""

    def __init__(self, message: str, stored: dict[str, int]) -> None:
        super().__init__(message)
        self.stored = stored


class SharesChangedError(ConsumerPositionError):
    """A consumer asks for its stream in a different number of shares (``share=(i, n)``)
    than its stored positions were applied in. Each share's position counts only its own
    keys, so starting from them under another split would skip or re-apply records;
    ``streamq reshare`` changes the split safely. ``stored`` maps each stored
    position's consumer name to its seq."""

    def __init__(self, message: str, stored: dict[str, int]) -> None:
        super().__init__(message)
        self.stored = stored


class OutOfOrderBatchError(StreamQError):
    """A batch applied out of turn: each must be applied once, in arrival order."""


class LeaseLostError(OutOfOrderBatchError):
    """A group member applied a batch of a share whose lease another member has taken
    since (this one was seen dead, or stopped renewing: paused, or cut off from the
    database). Nothing of that transaction commits; the share's new holder applies the
    batch. ``GroupConsumer`` drops the share and goes on with the others."""


class GroupSpecError(StreamQError):
    """A group member asks for another split than the group's stored one, or the group
    tables were written by a newer streamq."""


class RecordFailedError(StreamQError):
    """Applying one record failed every time it was tried, and the consumer's policy
    (``on_failure=streamq.Retry(...)``) gave up: the consumer stops before it, nothing of
    its batch committed. The application's last exception is the ``__cause__``.

    ``consumer``, ``producer_id``, ``address`` (where that producer was reached),
    ``stream`` and ``seq`` name the record; ``attempts`` is how many tries of it failed.
    """

    def __init__(
        self,
        message: str,
        *,
        consumer: str,
        producer_id: str,
        address: str,
        stream: str,
        seq: int,
        attempts: int,
    ) -> None:
        super().__init__(message)
        self.consumer = consumer
        self.producer_id = producer_id
        self.address = address
        self.stream = stream
        self.seq = seq
        self.attempts = attempts

    def __reduce__(self) -> Any:  # keyword-only arguments: picklable all the same
        return _record_failed, (self.args[0], self.__dict__)


def _record_failed(message: str, fields: dict[str, Any]) -> RecordFailedError:
    error = RecordFailedError.__new__(RecordFailedError, message)
    error.args = (message,)
    error.__dict__.update(fields)
    return error


class ConnectionLostError(StreamQError):
    """The connection to the peer failed; the underlying cause is chained."""


class TLSError(StreamQError):
    """The TLS handshake with the producer failed: wrong CA, expired or missing certificate,
    no common TLS version, or TLS on one side only. Not retried: it needs a fix."""


class TransactionClosedError(StreamQError):
    """A transaction was used after it committed or rolled back."""


class ConcurrentWriterError(StreamQError):
    """Something outside streamq wrote this producer's log rows while a transaction ran.

    streamq's own writers (any process, any connection) take seqs under the database's
    write lock and never cause it. The transaction was rolled back; it can be retried.
    """


class DatabaseOpenError(StreamQError, OSError):
    """A database that cannot be opened, or is not a database: the message names the file."""


class DatabaseUnavailableError(StreamQError):
    """A consumer's own database could not be used for ``db_reconnect_timeout`` seconds:
    its server stayed down (connections lost or refused), or another connection held its
    write lock past the busy timeout. The message names the database; the last driver
    error is chained."""


class AlreadyServedError(StreamQError):
    """Another process already serves this producer database: one process serves it,
    the others publish (``serve=False``, ``streamq.publish``). The message names both."""


class CaptureError(StreamQError):
    """Tables cannot be captured on this database (``Producer(capture=...)``): the
    message says why and what to change."""


class SchemaMissingError(StreamQError):
    """The database has no streamq log tables (or an older version of them): create
    them with ``streamq init DB``, by starting a ``Producer`` on it, or by a migration."""


class NotInTransactionError(StreamQError):
    """``streamq.publish`` or ``save_position`` on a connection outside a transaction:
    the record would commit alone, apart from the application's writes."""


class UnsupportedConnectionError(StreamQError, TypeError):
    """An object ``streamq.publish`` cannot write through: the message lists what can."""


class RecordTooLargeError(StreamQError, ValueError):
    """A record whose encoding exceeds what one frame may carry."""
