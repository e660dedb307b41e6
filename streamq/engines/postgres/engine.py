"""The PostgreSQL engine as the code above sees it (``engines.Engine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ...producer.storage import Features
from ...records import MAX_SEQ
from ...sql import Durability
from ..base import ModuleEngine, Tables

if TYPE_CHECKING:
    from ...consumer.position_store import PositionStore
    from ..leases import LeaseTable
    from .storage import PostgresStorage


class PostgresEngine(ModuleEngine):
    modules: ClassVar[dict[str, str]] = {
        "append": "streamq.engines.postgres.append",
        "schema": "streamq.engines.postgres.append",
        "positions": "streamq.engines.postgres.positions",
    }
    name = "postgresql"
    # Writers insert records unnumbered, with no lock; the serving producer numbers them
    # once committed (numbering.py). The producer's writer is an asyncio connection: a
    # transaction of many statements does not run on a thread of its own.
    features = Features(numbered_after_commit=True, single_writer=False, captures=True)
    max_seq = MAX_SEQ  # SQLite's, so that a log moves between engines

    def open_storage(self, target: str) -> PostgresStorage:
        from .storage import PostgresStorage

        return PostgresStorage(target)

    def tables(self, db: str) -> Tables:
        from .driver import connect, database

        where = database(db)
        with connect(db, where, application_name="streamq") as conn:
            rows = conn.execute(  # those the search path finds, as streamq's own queries do
                "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p') "
                "AND relname LIKE 'streamq%' AND pg_table_is_visible(oid)"
            ).fetchall()
        return Tables(where, frozenset(name for (name,) in rows))

    def open_position_store(
        self, db: str, durability: Durability, *, connect_timeout: float
    ) -> PositionStore:
        from .positions import PostgresPositionStore

        return PostgresPositionStore(db, durability, connect_timeout=connect_timeout)

    def open_leases(self, db: str, name: str, stream: str) -> LeaseTable:
        from .leases import PostgresLeases

        return PostgresLeases(db, name, stream)


ENGINE = PostgresEngine()
