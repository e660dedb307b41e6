"""The consumer's database, as the consumer uses it: one ``PositionStore`` per engine.

The consumer's database is SQLite (a path) or PostgreSQL (a ``postgresql://`` URL).
The consumer does not know which: it talks to a ``PositionStore``, one per engine
(``engines/sqlite/positions.py``, ``engines/postgres/positions.py``), each holding all
of its engine's SQL, picked once from ``db`` (``open_position_store``). The functions
here that take ``db`` (dead letters, resharing) pick the engine the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .batches import Batch
from .engines import Engine, for_target
from .errors import LeaseLostError, OutOfOrderBatchError, SchemaMissingError
from .storage import Durability

if TYPE_CHECKING:
    from .failures import DeadLetterSQL, ParkedRecord
    from .resharing import Move, OnlineMove

T = TypeVar("T")


def list_dead_letters(db: str, consumer: str | None = None) -> list[ParkedRecord]:
    """The records parked in the consumer database ``db`` (a SQLite file or a
    ``postgresql://`` URL), by consumer, stream and seq."""
    return consumer_database(db).list_dead_letters(db, consumer)


def mark_for_retry(
    db: str, consumer: str | None = None, stream: str | None = None, seq: int | None = None
) -> int:
    """Mark parked records (all, or those matching) for their consumer to re-apply, once,
    through its ``apply`` function (within about a second); how many were marked."""
    return consumer_database(db).mark_for_retry(db, consumer, stream, seq)


def reshare(db: str, consumer: str, shares: int) -> list[Move] | list[OnlineMove]:
    """Move ``consumer``'s stored positions in the consumer database ``db`` to a split into
    ``shares`` (1: unshared). A consumer group (``GroupConsumer``) moves while it runs;
    workers started with ``Consumer(share=)`` must be stopped first, and every share of the
    old split stand at the same seq; ``ReshareRefusedError`` otherwise
    (``streamq.resharing``)."""
    engine = consumer_database(db)
    if "streamq_groups" in engine.tables(db).names:
        online = engine.open_leases(db, consumer, "").reshare(shares)
        if online is not None:
            return online
    return engine.reshare(db, consumer, shares)


def consumer_database(db: str) -> Engine:
    """The engine of ``db``, checked to be a consumer's database: given the producer's (or
    any other), "no records parked" would be an answer from the wrong database."""
    engine = for_target(db)
    tables = engine.tables(db)
    if not tables.positions:
        whose = (
            "it is a producer's database (it holds the log)"
            if tables.log
            else "no Consumer(db=...) has opened it"
        )
        raise SchemaMissingError(
            f"{tables.where} has no consumer tables (streamq_positions): {whose}; give the "
            "consumer's database, the one its Consumer(db=...) stores positions in"
        )
    return engine


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

    async def close(self) -> None: ...

    async def load(self, consumer: str, stream: str) -> list[tuple[str, int, int, str]]:
        """(producer id, seq, epoch, endpoint) of each of ``consumer``'s positions on
        ``stream``: one per producer it applied from, and where it last reached it."""

    async def stored(self, consumer: str, producer_id: str, stream: str) -> int | None:
        """The position as committed, by the consumer or through ``save_position``."""

    async def shares_of(
        self, consumer: str, stream: str, producer_id: str, endpoint: str
    ) -> list[tuple[str, int]]:
        """(name, seq) of the positions stored under ``consumer`` and under names that
        start with ``consumer[`` (its shares), as ``load`` selects them."""

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


def open_position_store(
    db: str, durability: Durability = "normal", *, connect_timeout: float = 10.0
) -> PositionStore:
    """The store for ``db``: a ``postgresql://`` (or ``postgres://``) URL is a PostgreSQL
    database, anything else a SQLite file. Not opened yet."""
    return for_target(db).open_position_store(db, durability, connect_timeout=connect_timeout)


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
