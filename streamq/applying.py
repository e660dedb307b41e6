"""A consumer's position, written through the application's own connection.

The twin of ``streamq.publish`` on the consuming side: a consumer whose effects are
written by the application's own code (an ORM session, Django models, plain sqlite3)
stores the batch's position in that same transaction, so effects and position commit
together or not at all::

    async for batch in consumer:                 # Consumer(..., db=app_db, name="ledger")
        await asyncio.to_thread(apply, batch)

    def apply(batch):
        with Session(engine) as session, session.begin():
            session.add_all(Entry(...) for record in batch)
            streamq.save_position(session, batch)

The turn is checked in the database, under its write lock: the position stored must be
the one the batch follows, so a batch applied twice, or one skipped, raises
``OutOfOrderBatchError`` and its transaction must roll back. The consumer learns the
committed position when asked for its next batch, and acknowledges it to the producer.
"""

from __future__ import annotations

import time
from typing import Any

from .blocking import run_on_thread
from .connections import resolve, resolve_engine_async, sqlite_only
from .consumer import Batch
from .errors import OutOfOrderBatchError, SchemaMissingError

_ADVANCE = (
    "UPDATE streamq_positions SET seq = ?, epoch = ?, endpoint = ?, updated_at = ? "
    "WHERE consumer = ? AND producer_id = ? AND stream = ? AND seq = ?"
)
_FIRST = (
    "INSERT INTO streamq_positions "
    "(consumer, producer_id, stream, seq, epoch, endpoint, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_STORED = "SELECT seq FROM streamq_positions WHERE consumer = ? AND producer_id = ? AND stream = ?"


def save_position(conn: Any, batch: Batch) -> None:
    """Store ``batch``'s last seq as its consumer's position, in ``conn``'s open
    transaction (the one applying the batch's effects). ``conn`` is what ``publish``
    takes: a sqlite3 connection, a SQLAlchemy Connection or Session, Django's connection."""
    _advance(resolve(conn), batch)


async def save_position_async(conn: Any, batch: Batch) -> None:
    """``save_position`` for aiosqlite and SQLAlchemy's asyncio connections and sessions."""
    resolved = await resolve_engine_async(conn)
    if resolved.engine != "sqlite":
        raise sqlite_only(resolved.engine)
    await run_on_thread(resolved.dbapi, _advance, resolved.dbapi._conn, batch)


def _advance(dbapi: Any, batch: Batch) -> None:
    if not batch.consumer:
        raise ValueError("this batch comes from no named consumer: Consumer(..., name=...)")
    key = (batch.consumer, batch.producer_id, batch.stream)
    now = int(time.time() * 1000)
    cursor = dbapi.cursor()
    try:
        try:
            # The UPDATE takes the write lock before it reads: two processes applying one
            # batch cannot both find the position it follows.
            position = (batch.last_seq, batch.epoch, batch.endpoint, now, *key, batch.after)
            cursor.execute(_ADVANCE, position)
        except Exception as exc:
            if "no such table: streamq_positions" in str(exc):
                raise SchemaMissingError(
                    "this database has no streamq_positions table: open the Consumer with "
                    "db= this database (it creates the table) before applying through it"
                ) from exc
            raise
        if cursor.rowcount == 1:
            return
        # Holding the write lock since the UPDATE: what is stored cannot change meanwhile.
        cursor.execute(_STORED, key)
        row = cursor.fetchone()
        stored = None if row is None else row[0]
        if stored is None and batch.after == batch.origin:  # the consumer's first batch
            cursor.execute(_FIRST, (*key, batch.last_seq, batch.epoch, batch.endpoint, now))
            return
    finally:
        cursor.close()
    where = "nothing" if stored is None else f"up to seq {stored}"
    raise OutOfOrderBatchError(
        f"batch follows seq {batch.after}, but consumer {batch.consumer!r} has applied {where} "
        f"of stream {batch.stream!r} in this database: roll this transaction back "
        "(each batch is applied once, in the order received)"
    )
