"""What every engine is: the ``Engine`` interface, the ``Tables`` a database holds, and
``ModuleEngine``, the base that imports an engine's modules when first used. Below the
engines and their lookup (``streamq.engines``), so an engine's package imports this and
never the lookup that imports it."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..producer.storage import Features, Storage
from ..sql import Durability

if TYPE_CHECKING:
    from ..consumer.batch import Batch
    from ..consumer.position_store import ParkedRecord, PositionStore
    from ..consumer.resharing import Move
    from ..records import CheckedRecord, Receipt, Unnumbered
    from .leases import LeaseTable


@dataclass(frozen=True, slots=True)
class Tables:
    """The streamq tables a database holds, read without creating any: whose database it
    is, for commands that must refuse the wrong one instead of answering from it."""

    where: str  # the database as messages name it (a URL without its password)
    names: frozenset[str]

    @property
    def log(self) -> bool:
        """A producer's database: it holds the log tables."""
        return "streamq_streams" in self.names

    @property
    def positions(self) -> bool:
        """A consumer's database: a ``Consumer(db=...)`` opened it and made its tables."""
        return "streamq_positions" in self.names


class Engine(Protocol):
    """One database engine: a producer's storage, a consumer's position store, and what
    the application's own connection runs (publish, positions, tables)."""

    name: str  # as connections.resolve_engine names it: "sqlite", "postgresql"
    features: Features
    max_seq: int  # the largest seq it stores

    def open_storage(self, target: str) -> Storage: ...

    def tables(self, db: str) -> Tables:
        """The streamq tables in the existing database ``db``, changing nothing (a
        database that cannot be opened: ``DatabaseOpenError``)."""
        ...

    def open_position_store(
        self, db: str, durability: Durability, *, connect_timeout: float
    ) -> PositionStore: ...

    def append(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> list[int] | Receipt:
        """Publish in the connection's open transaction: seqs, or a ``Receipt`` where
        ``features.numbered_after_commit``."""
        ...

    async def append_async(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> list[int] | Receipt: ...

    def append_unnumbered(self, dbapi: Any, stream: str, records: Unnumbered) -> range | Receipt:
        """``append`` of records encoded already, elsewhere (``records.Unnumbered``)."""
        ...

    def open_leases(self, db: str, name: str, stream: str) -> LeaseTable:
        """A consumer group member's rows (``engines.leases``), not connected yet."""
        ...

    def create_schema(self, dbapi: Any) -> None: ...

    async def create_schema_async(self, dbapi: Any) -> None: ...

    def save_position(self, dbapi: Any, batch: Batch) -> None: ...

    async def save_position_async(self, dbapi: Any, batch: Batch) -> None: ...

    def list_dead_letters(self, db: str, consumer: str | None) -> list[ParkedRecord]: ...

    def mark_for_retry(
        self, db: str, consumer: str | None, stream: str | None, seq: int | None
    ) -> int: ...

    def reshare(self, db: str, consumer: str, shares: int) -> list[Move]: ...


class ModuleEngine:
    """What an engine does on the application's connection, and with a consumer's
    database, by its own modules, imported when first used: ``append`` (``append``,
    ``append_async``), ``schema`` (``create_schema``, its async twin) and ``positions``
    (``save_position``, its async twin, dead letters, resharing)."""

    modules: ClassVar[dict[str, str]]  # role -> module name

    def __init__(self) -> None:
        self._imported: dict[str, ModuleType] = {}

    def _module(self, role: str) -> ModuleType:
        module = self._imported.get(role)
        if module is None:  # import_module costs microseconds even once imported
            module = self._imported[role] = importlib.import_module(self.modules[role])
        return module

    def append(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> Any:
        return self._module("append").append(
            dbapi, stream, records, max_record_size=max_record_size
        )

    async def append_async(
        self, dbapi: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
    ) -> Any:
        append_async = self._module("append").append_async
        return await append_async(dbapi, stream, records, max_record_size=max_record_size)

    def append_unnumbered(self, dbapi: Any, stream: str, records: Unnumbered) -> Any:
        return self._module("append").append_unnumbered(dbapi, stream, records)

    def create_schema(self, dbapi: Any) -> None:
        self._module("schema").create_schema(dbapi)

    async def create_schema_async(self, dbapi: Any) -> None:
        await self._module("schema").create_schema_async(dbapi)

    def save_position(self, dbapi: Any, batch: Batch) -> None:
        self._module("positions").save_position(dbapi, batch)

    async def save_position_async(self, dbapi: Any, batch: Batch) -> None:
        await self._module("positions").save_position_async(dbapi, batch)

    def list_dead_letters(self, db: str, consumer: str | None) -> list[ParkedRecord]:
        parked: list[ParkedRecord] = self._module("positions").list_dead_letters(db, consumer)
        return parked

    def mark_for_retry(
        self, db: str, consumer: str | None, stream: str | None, seq: int | None
    ) -> int:
        return int(self._module("positions").mark_for_retry(db, consumer, stream, seq))

    def reshare(self, db: str, consumer: str, shares: int) -> list[Move]:
        moves: list[Move] = self._module("positions").reshare(db, consumer, shares)
        return moves
