"""What a consumer's database is to the code above it, and what it stores: the interface
each engine's position store implements (``PositionStore``, its ``ConsumerTransaction``),
the dead letters' statements and rows (``DeadLetterSQL``, ``ParkedRecord``), and the
errors a store raises for a batch out of turn or applied under a lost lease.

The engines (``engines/*/positions.py``) import these from here, below them; the consumer,
its failure policies and ``database`` (which picks an engine for a database) import them
too. This module imports none of those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import msgpack

from ..captured import record_json
from ..errors import LeaseLostError, OutOfOrderBatchError
from ..protocol import Record
from .batch import Batch

T = TypeVar("T")


class DeadLetterSQL(NamedTuple):
    """An engine's statements on ``streamq_dead_letters`` (placeholders its own)."""

    park: str  # (consumer, producer_id, stream, seq, key, value, headers, timestamp,
    #            error, attempts, parked_at)
    requested: str  # (consumer, producer_id, stream) -> seq, timestamp, key, value, headers
    take: str  # delete one marked for retry: (consumer, producer_id, stream, seq)
    failed_again: str  # (error, consumer, producer_id, stream, seq)


class ParkedRecord(NamedTuple):
    """A record a ``DeadLetter`` consumer parked (``streamq.list_dead_letters``)."""

    consumer: str
    producer_id: str
    stream: str
    record: Record
    error: str  # the application's exception, with its traceback
    attempts: int  # tries of the record that failed
    parked_at: int  # ms since the Unix epoch
    retry_requested_at: int | None  # set by ``mark_for_retry`` until the consumer re-applies

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> ParkedRecord:
        """A row of ``streamq_dead_letters`` as both engines select it."""
        consumer, producer_id, stream, seq, timestamp, key, value, headers, *rest = row
        record = stored_record(seq, timestamp, key, value, headers)
        error, attempts, parked_at, requested = rest
        requested = None if requested is None else int(requested)
        return cls(consumer, producer_id, stream, record, error, attempts, parked_at, requested)

    def as_json(self) -> dict[str, Any]:
        """As ``streamq dead-letters list --json`` and the console show it."""
        return {
            "consumer": self.consumer,
            "producer_id": self.producer_id,
            "stream": self.stream,
            **record_json(self.record),
            "error": self.error,
            "attempts": self.attempts,
            "parked_at": self.parked_at,
            "retry_requested_at": self.retry_requested_at,
        }


def stored_record(seq: Any, timestamp: Any, key: Any, value: Any, headers: Any) -> Record:
    """A parked record from the columns of its row, as either engine's driver returns them."""
    return Record(int(seq), int(timestamp), _bytes(key), bytes(value), _headers(headers))


def _bytes(data: Any) -> bytes | None:
    return None if data is None else bytes(data)


def _headers(data: Any) -> dict[str, bytes]:
    return cast(dict[str, bytes], msgpack.unpackb(bytes(data), raw=False))


class ConsumerTransaction(Protocol):
    """One transaction on the consumer's database, committed with the batch's position.

    Statements are the engine's own: ``?`` placeholders on SQLite (an aiosqlite cursor
    comes back), ``%s`` on PostgreSQL (a psycopg ``AsyncCursor``).
    """

    async def execute(self, sql: str, parameters: Any = ...) -> Any:
        """Run the application's SQL inside this transaction."""

    async def executemany(self, sql: str, parameters: Any) -> Any:
        """``execute`` once per parameter set, in one call to the driver."""


class PositionStore(Protocol):
    """The consumer's database, as the consumer uses it: positions, and batches applied
    with them. One class per engine; the consumer never asks which, and calls one
    method at a time (under its transaction lock).

    A position moves only from the seq a batch follows (``Batch.after``) to its last, in
    the transaction applying it, checked in the database under its locks: a batch that a
    racing process already applied gets ``OutOfOrderBatchError``, before the
    application's SQL runs, and nothing commits.
    """

    where: str  # names the database in errors
    dead_letters: DeadLetterSQL

    @property
    def connection(self) -> Any:
        """The engine's asyncio connection (for tests and tools that reach under this)."""

    async def open(self) -> None:
        """Connect, and create the positions table if missing (``DatabaseOpenError``)."""

    def unavailable(self, error: BaseException) -> bool:
        """``error`` says the database could not be used for now, and trying again later
        may succeed: the connection lost or refused (the server restarting), the write
        lock held by another connection past the busy timeout. The next call connects
        again where it must."""

    async def close(self) -> None: ...

    async def load(self, consumer: str, stream: str) -> list[tuple[str, int, int, str]]:
        """(producer id, seq, epoch, endpoint) of each of ``consumer``'s positions on
        ``stream``: one per producer it applied from, and where it last reached it."""

    async def stored(self, consumer: str, producer_id: str, stream: str) -> int | None:
        """The position as committed, by the consumer or through ``save_position``."""

    async def names_on(
        self, stream: str, producer_id: str, endpoint: str
    ) -> list[tuple[str, str, int]]:
        """(consumer name, producer id, seq) of every position stored for ``stream`` of
        the producer ``producer_id``, or of any producer last reached at ``endpoint``:
        a consumer's shares, and the names of others applying the same stream here."""

    def transaction(
        self, batch: Batch, committed: Callable[[], None]
    ) -> AbstractAsyncContextManager[ConsumerTransaction]:
        """One transaction applying ``batch`` with its position; ``committed()`` runs
        once its COMMIT went through, even if the caller was cancelled meanwhile."""

    async def apply(
        self,
        batch: Batch,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        committed: Callable[[], None],
    ) -> T:
        """``fn(tx, batch, *args)`` with blocking statements, in one transaction with the
        position, off the event loop; then ``committed()`` as for ``transaction``."""

    async def run_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tx, *args)`` as ``apply`` runs it, in one transaction that leaves the
        positions alone (the dead letters' own)."""


def out_of_turn(batch: Batch, stored: int | None) -> OutOfOrderBatchError:
    """The error for ``batch`` when its consumer's database holds ``stored`` (None:
    nothing) as the position: another transaction applied it, or one was skipped."""
    where = "nothing" if stored is None else f"up to seq {stored}"
    return OutOfOrderBatchError(
        f"batch follows seq {batch.after}, but consumer {batch.consumer!r} has applied {where} "
        f"of stream {batch.stream!r} in this database: roll this transaction back "
        "(each batch is applied once, in the order received)"
    )


def lease_lost(batch: Batch) -> LeaseLostError:
    """The error for ``batch`` applied under a group lease (``Batch.fence``) whose token
    has moved on: another member took the share."""
    assert batch.fence is not None
    return LeaseLostError(
        f"consumer group {batch.fence.group!r}: this worker no longer holds share "
        f"{batch.fence.share} of stream {batch.stream!r} (another member took it over after "
        "this one was seen dead or stopped renewing its lease); the batch is not applied "
        "here: the share's new holder applies it"
    )
