"""The SQLite engine as the code above sees it (``engines.Engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...records import MAX_SEQ
from ...storage import Durability, Features

if TYPE_CHECKING:
    from ...batches import Batch
    from ...failures import ParkedRecord
    from ...records import CheckedRecord
    from ...resharing import Move
    from ...stores import PositionStore
    from .storage import SQLiteStorage


class SQLiteEngine:
    name = "sqlite"
    # One writer at a time: a record's seq is known when it is published, and a whole
    # transaction can run on the writer's own thread.
    features = Features(numbered_after_commit=False, blocking_transactions=True)
    max_seq = MAX_SEQ  # seqs are packed in 40 bits of the log's key

    def open_storage(self, target: str) -> SQLiteStorage:
        from .storage import SQLiteStorage

        return SQLiteStorage(target)

    def open_position_store(
        self, db: str, durability: Durability, *, connect_timeout: float
    ) -> PositionStore:
        from .positions import SQLitePositionStore

        return SQLitePositionStore(db, durability)

    def append(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> list[int]:
        from .append import append

        return append(dbapi, stream, records, max_record_size=max_record_size)

    async def append_async(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> list[int]:
        from .append import append_async

        return await append_async(dbapi, stream, records, max_record_size=max_record_size)

    def create_schema(self, dbapi: Any) -> None:
        from .storage import create_schema

        create_schema(dbapi)

    def save_position(self, dbapi: Any, batch: Batch) -> None:
        from .positions import save_position

        save_position(dbapi, batch)

    async def save_position_async(self, dbapi: Any, batch: Batch) -> None:
        from .positions import save_position_async

        await save_position_async(dbapi, batch)

    def list_dead_letters(self, db: str, consumer: str | None) -> list[ParkedRecord]:
        from .positions import list_dead_letters

        return list_dead_letters(db, consumer)

    def mark_for_retry(
        self, db: str, consumer: str | None, stream: str | None, seq: int | None
    ) -> int:
        from .positions import mark_for_retry

        return mark_for_retry(db, consumer, stream, seq)

    def reshare(self, db: str, consumer: str, shares: int) -> list[Move]:
        from .positions import reshare

        return reshare(db, consumer, shares)


ENGINE = SQLiteEngine()
