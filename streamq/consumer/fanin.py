"""Fan-in: one consumer reading the same stream from several producers.

Each producer keeps its own connection, its own ``Consumer`` (reconnects, backoff,
identity checks) and its own position row, keyed (consumer, producer id, stream)
in ``streamq_positions``; all of them apply into one database (SQLite or PostgreSQL)
through one position store. Batches come one producer at a time, each producer's in seq order, so
``transaction(batch)`` is exactly-once per producer as with a single ``Consumer``.
A producer that is down (killed, restarting) only pauses its own records.
The name's positions from the producers at the listed addresses are expected; one from
a producer at none of them makes a producer new to the name refused, as for a single
``Consumer`` (``allow_new_producer=True`` opts in).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ..metrics import MetricsEndpoint
from ..sql import Durability
from .batch import Batch
from .consumer import Consumer
from .database import ConsumerTransaction, PositionStore, open_position_store

T = TypeVar("T")


class FanInConsumer:
    """``async with FanInConsumer([a1, a2, a3], "orders", db="billing.db", name="billing")``.

    Iterate for batches, apply each with ``transaction(batch)``; other keyword
    arguments (``reconnect_timeout``, ``queue_batches``, ``metrics=``, ...) go to every
    ``Consumer``. ``metrics_port`` serves all their metrics on one endpoint
    (``metrics_address``), one series per producer address.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        stream: str,
        *,
        db: str | None = None,
        name: str | None = None,
        durability: Durability = "normal",
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        **options: Any,
    ) -> None:
        if not addresses:
            raise ValueError("a fan-in consumer needs at least one producer address")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"each producer address once, not {list(addresses)}")
        if db is not None and not name:
            raise ValueError("a consumer with a database needs a name= to store its position under")
        self.stream = stream
        self.name = name or "anonymous"
        self._metrics = MetricsEndpoint(metrics_port, metrics_host, options.get("metrics"))
        if self._metrics.collector is not None:  # every producer's consumer reports there
            options["metrics"] = self._metrics.collector
        self.consumers = [
            Consumer(address, stream, name=name, durability=durability, **options)
            for address in addresses
        ]
        for consumer in self.consumers:  # the others' positions under this name are expected
            consumer.siblings = frozenset(addresses) - {consumer.address}
        self._store: PositionStore | None = None
        if db is not None:
            self._store = open_position_store(db, durability)
        self._by_producer: dict[str, Consumer] = {}
        self._next: dict[Consumer, asyncio.Task[Batch]] = {}
        self._turn = 0  # which producer's ready batch goes first: none starves
        self._closed = False

    async def start(self) -> None:
        """Open the database and subscribe to every producer; raises if one refuses."""
        try:
            self._metrics.open()
            if self._store is not None:
                await self._store.open()
                lock = asyncio.Lock()  # one transaction at a time on the shared connection
                for consumer in self.consumers:
                    consumer.apply_into(self._store, lock)
            await asyncio.gather(*(consumer.start() for consumer in self.consumers))
            for consumer in self.consumers:
                assert consumer.producer_id is not None
                other = self._by_producer.setdefault(consumer.producer_id, consumer)
                if other is not consumer:
                    raise ValueError(
                        f"{other.address} and {consumer.address} serve the same producer "
                        f"{consumer.producer_id}: read each producer once"
                    )
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close every producer's connection, then the shared database."""
        if self._closed:
            return
        self._closed = True
        for task in self._next.values():
            task.cancel()
        await asyncio.gather(*self._next.values(), return_exceptions=True)
        await asyncio.gather(*(consumer.close() for consumer in self.consumers))
        await self._metrics.close()
        if self._store is not None:
            await self._store.close()

    async def __aenter__(self) -> FanInConsumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __aiter__(self) -> FanInConsumer:
        return self

    async def __anext__(self) -> Batch:
        """The next batch from whichever producer has one; a producer's error is raised."""
        if self._closed:
            raise StopAsyncIteration
        for consumer in self.consumers:
            if consumer not in self._next:
                self._next[consumer] = asyncio.ensure_future(consumer.__anext__())
        # Cancelling this wait leaves the reads running: no batch is ever dropped.
        done, _ = await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
        count = len(self.consumers)
        for i in range(count):
            consumer = self.consumers[(self._turn + i) % count]
            if self._next[consumer] in done:
                self._turn = (self._turn + i + 1) % count
                return self._next.pop(consumer).result()
        raise AssertionError("asyncio.wait returned no finished read")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def transaction(self, batch: Batch) -> AsyncIterator[ConsumerTransaction]:
        """Apply ``batch`` and store its producer's position, in one transaction."""
        async with self._consumer_of(batch).transaction(batch) as tx:
            yield tx

    async def apply(self, batch: Batch, fn: Callable[..., T], *args: Any) -> T:
        """``Consumer.apply`` on the consumer of the producer ``batch`` came from."""
        return await self._consumer_of(batch).apply(batch, fn, *args)

    def _consumer_of(self, batch: Batch) -> Consumer:
        try:
            return self._by_producer[batch.producer_id]
        except KeyError:
            raise ValueError(f"batch from producer {batch.producer_id}, not read here") from None

    @property
    def metrics_address(self) -> str:
        """``host:port`` of the Prometheus endpoint of all the producers' consumers."""
        return self._metrics.address

    @property
    def lag(self) -> int:
        """Records committed by all the producers and not yet applied here."""
        return sum(consumer.lag for consumer in self.consumers)

    async def fetch_lag(self) -> int:
        """The exact lag now, asking every producer for its head (see ``Consumer.fetch_lag``)."""
        return sum(await asyncio.gather(*(c.fetch_lag() for c in self.consumers)))

    @property
    def applied(self) -> dict[str, int]:
        """Producer address -> last seq applied from it."""
        return {consumer.address: consumer.applied for consumer in self.consumers}
