"""The SQLite engine as the code above sees it (``engines.Engine``)."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, ClassVar
from urllib.request import pathname2url

from ...errors import DatabaseOpenError
from ...producer.storage import Features
from ...records import MAX_SEQ
from ...sql import Durability
from ..base import ModuleEngine, Tables

if TYPE_CHECKING:
    from ...consumer.position_store import PositionStore
    from ..leases import LeaseTable
    from .storage import SQLiteStorage


class SQLiteEngine(ModuleEngine):
    modules: ClassVar[dict[str, str]] = {
        "append": "streamq.engines.sqlite.append",
        "schema": "streamq.engines.sqlite.storage",
        "positions": "streamq.engines.sqlite.positions",
    }
    name = "sqlite"
    # One writer at a time: a record's seq is known when it is published, and a whole
    # transaction can run on the writer's own thread.
    features = Features(numbered_after_commit=False, single_writer=True)
    max_seq = MAX_SEQ  # seqs are packed in 40 bits of the log's key

    def open_storage(self, target: str) -> SQLiteStorage:
        from .storage import SQLiteStorage

        return SQLiteStorage(target)

    def tables(self, db: str) -> Tables:
        where = f"SQLite database {db!r}"
        try:  # mode=rw: a missing file is an error, never created
            conn = sqlite3.connect(f"file:{pathname2url(db)}?mode=rw", uri=True, timeout=10)
        except sqlite3.Error as exc:
            raise DatabaseOpenError(f"cannot open {where}: {exc}") from exc
        try:
            rows = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'streamq%'"
            ).fetchall()
        except sqlite3.DatabaseError as exc:  # "file is not a database"
            raise DatabaseOpenError(f"cannot open {where}: {exc}") from exc
        finally:
            conn.close()
        return Tables(where, frozenset(name for (name,) in rows))

    def open_position_store(
        self, db: str, durability: Durability, *, connect_timeout: float
    ) -> PositionStore:
        from .positions import SQLitePositionStore

        return SQLitePositionStore(db, durability)

    def open_leases(self, db: str, name: str, stream: str) -> LeaseTable:
        from .leases import SQLiteLeases

        return SQLiteLeases(db, name, stream)


ENGINE = SQLiteEngine()
