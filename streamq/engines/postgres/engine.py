"""The PostgreSQL engine as the code above sees it (``engines.Engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...records import MAX_SEQ
from ...storage import Durability, Features

if TYPE_CHECKING:
    from ...batches import Batch
    from ...failures import ParkedRecord
    from ...records import CheckedRecord, Receipt
    from ...resharing import Move
    from ...stores import PositionStore
    from .storage import PostgresStorage


class PostgresEngine:
    name = "postgresql"
    # Writers insert records unnumbered, with no lock; the serving producer numbers them
    # once committed (numbering.py). The producer's writer is an asyncio connection: a
    # transaction of many statements does not run on a thread of its own.
    features = Features(numbered_after_commit=True, blocking_transactions=False)
    max_seq = MAX_SEQ  # SQLite's, so that a log moves between engines

    def open_storage(self, target: str) -> PostgresStorage:
        from .storage import PostgresStorage

        return PostgresStorage(target)

    def open_position_store(
        self, db: str, durability: Durability, *, connect_timeout: float
    ) -> PositionStore:
        from .positions import PostgresPositionStore

        return PostgresPositionStore(db, durability, connect_timeout=connect_timeout)

    def append(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> Receipt:
        from .append import append

        return append(dbapi, stream, records, max_record_size=max_record_size)

    async def append_async(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> Receipt:
        from .append import append_async

        return await append_async(dbapi, stream, records, max_record_size=max_record_size)

    def create_schema(self, dbapi: Any) -> None:
        from .append import create_schema

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


ENGINE = PostgresEngine()
