"""The consumer's database, picked by engine: one ``PositionStore`` per engine.

The consumer's database is SQLite (a path) or PostgreSQL (a ``postgresql://`` URL).
The consumer does not know which: it talks to a ``PositionStore`` (the interface is in
``position_store``), one per engine (``engines/sqlite/positions.py``,
``engines/postgres/positions.py``), each holding all of its engine's SQL, picked once
from ``db`` (``open_position_store``). The functions here that take ``db`` (dead
letters, resharing) pick the engine the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engines import Engine, for_target
from ..errors import SchemaMissingError
from ..sql import Durability
from .position_store import ConsumerTransaction, ParkedRecord, PositionStore

if TYPE_CHECKING:
    from .resharing import Move, OnlineMove

__all__ = [
    "ConsumerTransaction",
    "PositionStore",
    "consumer_database",
    "list_dead_letters",
    "mark_for_retry",
    "open_position_store",
    "reshare",
]


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


def open_position_store(
    db: str, durability: Durability = "normal", *, connect_timeout: float = 10.0
) -> PositionStore:
    """The store for ``db``: a ``postgresql://`` (or ``postgres://``) URL is a PostgreSQL
    database, anything else a SQLite file. Not opened yet."""
    return for_target(db).open_position_store(db, durability, connect_timeout=connect_timeout)
