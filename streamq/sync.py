"""A blocking facade over ``Producer`` for services without asyncio (Flask, Django, scripts).

The producer and its server run on an event loop in a background thread;
each call hands a coroutine to that loop and waits for its result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from types import TracebackType
from typing import Any, TypeVar

from ._loop import loop_factory
from .compaction import Compacted
from .positions import ConsumerLag
from .producer import Producer, Transaction
from .protocol import Record
from .retention import Truncation

T = TypeVar("T")


class SyncCursor:
    """The rows and counters of one statement, fetched eagerly."""

    def __init__(self, rows: list[Any], rowcount: int, lastrowid: int | None) -> None:
        self._rows = rows
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def fetchall(self) -> list[Any]:
        return self._rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None


class SyncTransaction:
    """The blocking twin of ``Transaction``."""

    def __init__(self, producer: SyncProducer, tx: Transaction) -> None:
        self._producer = producer
        self._tx = tx

    def execute(self, sql: str, parameters: Iterable[Any] = ()) -> SyncCursor:
        async def run() -> SyncCursor:
            cursor = await self._tx.execute(sql, parameters)
            rows = list(await cursor.fetchall())
            return SyncCursor(rows, cursor.rowcount, cursor.lastrowid)

        return self._producer._call(run())

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int:
        return self._producer._call(
            self._tx.publish(stream, value, key=key, headers=headers, timestamp=timestamp)
        )

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        return self._producer._call(self._tx.publish_many(stream, values))


class SyncProducer:
    """``Producer`` for blocking code: ``with SyncProducer("orders.db") as p:``."""

    def __init__(self, path: str, **options: Any) -> None:
        self._loop = (loop_factory() or asyncio.new_event_loop)()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamq", daemon=True)
        self._thread.start()
        self._producer = Producer(path, **options)
        try:
            self._call(self._producer.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("SyncProducer methods cannot be called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._producer.close())
        self._stop_loop()

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def address(self) -> str:
        return self._producer.address

    @property
    def producer_id(self) -> str:
        return self._producer.producer_id

    def head(self, stream: str) -> int:
        return self._producer.head(stream)

    @contextmanager
    def transaction(self) -> Iterator[SyncTransaction]:
        """One transaction; commits when the block ends, rolls back if it raises."""
        context: AbstractAsyncContextManager[Transaction] = self._producer.transaction()
        tx = self._call(context.__aenter__())
        try:
            yield SyncTransaction(self, tx)
        except BaseException as exc:
            self._call(context.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        self._call(context.__aexit__(None, None, None))

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> int:
        return self._call(self._producer.publish(stream, value, key=key, headers=headers))

    def run_in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` as one transaction on the writer's thread (see ``Producer``)."""
        return self._call(self._producer.run_in_transaction(fn, *args))

    def query(self, sql: str, parameters: Iterable[Any] = ()) -> list[Any]:
        """Rows of a read-only query on the producer's database (in a transaction of its own)."""
        with self.transaction() as tx:
            return tx.execute(sql, parameters).fetchall()

    def create_stream(
        self,
        name: str,
        *,
        key_index: bool = False,
        compact: bool = False,
        notify_compacted: bool = False,
    ) -> None:
        self._call(
            self._producer.create_stream(
                name, key_index=key_index, compact=compact, notify_compacted=notify_compacted
            )
        )

    def compact(self, stream: str) -> list[Compacted]:
        return self._call(self._producer.compact(stream))

    def truncate(self, stream: str, before: int) -> None:
        self._call(self._producer.truncate(stream, before))

    def history(self, stream: str, key: bytes, from_seq: int | None = None) -> list[Record]:
        return self._call(self._producer.history(stream, key, from_seq))

    def seek_time(self, stream: str, timestamp: int) -> int:
        return self._call(self._producer.seek_time(stream, timestamp))

    def wait_applied(
        self, consumer: str, stream: str, seq: int, *, timeout: float | None = None
    ) -> int:
        """Block until ``consumer`` reports ``stream`` applied up to ``seq``; see ``Producer``."""
        return self._call(self._producer.wait_applied(consumer, stream, seq, timeout=timeout))

    def consumer_lags(self) -> list[ConsumerLag]:
        return self._producer.consumer_lags()

    def register_consumer(self, consumer: str, stream: str) -> None:
        self._call(self._producer.register_consumer(consumer, stream))

    def unregister_consumer(self, consumer: str, stream: str) -> bool:
        return self._call(self._producer.unregister_consumer(consumer, stream))

    def apply_retention(self) -> list[Truncation]:
        return self._call(self._producer.apply_retention())
