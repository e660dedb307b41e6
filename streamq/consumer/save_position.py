"""A consumer's position, written through the application's own connection.

The twin of ``streamq.publish`` on the consuming side: a consumer whose effects are
written by the application's own code (an ORM session, Django models, plain sqlite3 or
psycopg) stores the batch's position in that same transaction, so effects and position
commit together or not at all, in SQLite or PostgreSQL alike::

    async for batch in consumer:                 # Consumer(..., db=app_db, name="ledger")
        await asyncio.to_thread(apply, batch)

    def apply(batch):
        with Session(engine) as session, session.begin():
            session.add_all(Entry(...) for record in batch)
            streamq.save_position(session, batch)

The turn is checked in the database, under its locks (SQLite's write lock, PostgreSQL's
row lock: ``engines/*/positions.py``): the position stored must be the one the batch
follows, so a batch applied twice, or one skipped, raises ``OutOfOrderBatchError`` and
its transaction must roll back. The consumer learns the committed position when asked
for its next batch, and while that is awaited (every ``consumer.SAVED_POLL`` seconds
until it has), and acknowledges it to the producer.
"""

from __future__ import annotations

from typing import Any

from ..engines import for_connection, for_connection_async
from ..engines.app_connection import SAVE_POSITION
from .batch import Batch


def save_position(conn: Any, batch: Batch) -> None:
    """Store ``batch``'s last seq as its consumer's position, in ``conn``'s open
    transaction (the one applying the batch's effects). ``conn`` is what ``publish``
    takes: a sqlite3 or psycopg connection, a SQLAlchemy Connection or Session, Django's
    connection."""
    _check(batch)
    engine, dbapi = for_connection(conn, SAVE_POSITION)
    engine.save_position(dbapi, batch)


async def save_position_async(conn: Any, batch: Batch) -> None:
    """``save_position`` for asyncio connections: aiosqlite, psycopg's ``AsyncConnection``,
    asyncpg's ``Connection`` (or a pool's), SQLAlchemy's ``AsyncConnection`` and
    ``AsyncSession``: what ``publish_async`` takes."""
    _check(batch)
    engine, dbapi = await for_connection_async(conn, SAVE_POSITION)
    await engine.save_position_async(dbapi, batch)


def _check(batch: Batch) -> None:
    if not isinstance(batch, Batch):
        raise TypeError(
            f"save_position takes the streamq.Batch being applied, not a {type(batch).__name__}"
        )
    if not batch.consumer:
        raise ValueError("this batch comes from no named consumer: Consumer(..., name=...)")
