"""A consumer's turn to apply: the next batch of its stream, one transaction at a time.

``Consumer`` and its failure policies (``failures.Policies``) apply only through a
``Turn``: its ``lock`` (one transaction at a time on the database's connection),
``store`` (the consumer's database), ``check(batch)`` (the store, if it is ``batch``'s
turn) and ``applied(batch)`` (it committed). The consumers of a ``FanInConsumer`` or a
``GroupConsumer`` share one store and lock (``share``); a group member's share applies
under its lease (``fence``), which the store checks inside the transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import OutOfOrderBatchError
from .batch import Batch, Fence
from .position_store import PositionStore


class Turn:
    """Where and whose turn it is to apply, for one consumer: ``name`` on ``stream`` from
    the producer ``producer_id`` at ``address``, at ``position``. ``committed()`` is
    called each time the position moved by a commit (the consumer acknowledges it)."""

    def __init__(
        self,
        name: str,
        stream: str,
        address: str,
        store: PositionStore | None,
        committed: Callable[[], None],
    ) -> None:
        self.name, self.stream, self.address = name, stream, address
        self.store = store  # None: nothing to apply into (a plain tail)
        self.lock = asyncio.Lock()  # one transaction at a time on the store's connection
        self.producer_id: str | None = None  # the producer it applies from, once reached
        self.position = 0  # last seq committed (or delivered, without a database)
        self.origin = 0  # the configured start's position, when none was stored
        self.fence: Fence | None = None  # the group lease this consumer's share applies under
        self.batches = 0  # batches committed through this turn
        self.records = 0  # records committed in their batch, parked ones not counted
        self._committed = committed

    def share(self, store: PositionStore, lock: asyncio.Lock) -> None:
        """Apply into ``store``, opened by someone else (a ``FanInConsumer``, a
        ``GroupConsumer``), one transaction at a time with the others by ``lock``."""
        self.store, self.lock = store, lock

    def check(self, batch: Batch) -> PositionStore:
        """The store to apply ``batch`` into, if it is the next one to apply (as this
        process knows it: the store checks again in the database, against other
        processes). Called with ``lock`` held."""
        if self.store is None:
            raise RuntimeError("this consumer has no database (db=None): nothing to apply into")
        if batch.consumer != self.name or batch.stream != self.stream:
            raise ValueError(
                f"batch of consumer {batch.consumer!r} on stream {batch.stream!r}: apply it "
                f"with the consumer that received it, not {self.name!r} on {self.stream!r}"
            )
        if batch.after != self.position or batch.producer_id != self.producer_id:
            raise OutOfOrderBatchError(
                f"batch follows seq {batch.after}, but consumer {self.name!r} has applied up "
                f"to {self.position}: apply every batch once, in the order received"
            )
        return self.store

    def applied(self, batch: Batch, parked: int = 0) -> None:
        """``batch`` committed, ``parked`` of its records in the dead letters."""
        self.position = batch.last_seq
        self.batches += 1
        self.records += len(batch.records) - parked
        self._committed()

    async def catch_up(self) -> None:
        """Learn the position ``streamq.save_position`` committed through the application's
        own connection (the consumer did not run that transaction)."""
        if self.store is None or self.producer_id is None or self.lock.locked():
            return  # a transaction under way moves the position itself
        async with self.lock:  # free: taken at once, so no transaction starts meanwhile
            seq = await self.store.stored(self.name, self.producer_id, self.stream)
        if seq is not None and seq > self.position:
            self.position = seq
            self._committed()
