"""A blocking facade over ``Producer`` for services without asyncio (Flask, Django, scripts).

Transactions run on the calling thread, on a connection of that thread's own
(``storage.Session``), appending as ``streamq.publish`` does on the application's
connection: no hop to another thread, and no lock held across another thread's commit, so
threads and processes publish at once.
The server runs on an event loop in a background thread, woken after each commit; the
other calls (history, compaction, retention) hand a coroutine to that loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from ._loop import loop_factory
from .producer.compaction import Compacted
from .producer.consumer_positions import ConsumerLag
from .producer.producer import Producer
from .producer.retention import Truncation
from .producer.storage import Session
from .producer.transactions import SyncTransaction
from .protocol import Record
from .records import Receipt

__all__ = ["SyncProducer", "SyncTransaction"]

T = TypeVar("T")


class SyncProducer:
    """``Producer`` for blocking code: ``with SyncProducer("orders.db") as p:`` (or a
    ``postgresql://`` URL)."""

    def __init__(self, path: str, **options: Any) -> None:
        self._path = str(path)
        self._local = threading.local()
        self._sessions: list[Session] = []
        self._connections_lock = threading.Lock()
        self._loop = (loop_factory() or asyncio.new_event_loop)()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamq", daemon=True)
        self._thread.start()
        self._serves = options.get("serve", True)
        try:  # a refused database or option stops the loop's thread too
            self._producer = Producer(path, **options)
            self._call(self._producer.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("SyncProducer methods cannot be called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call_fresh(self, coro: Coroutine[Any, Any, T]) -> T:
        """``_call``, once the producer has caught up with this object's commits (made on
        other connections): what it reads in memory includes them."""

        async def fresh() -> T:
            await self._producer.refresh()
            return await coro

        return self._call(fresh())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        """Stop serving, close the database and every thread's session (idempotent)."""
        if self._loop.is_closed():
            return
        self._call(self._producer.close())
        self._stop_loop()
        with self._connections_lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()

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
        """``host:port`` where consumers connect."""
        return self._producer.address

    @property
    def producer_id(self) -> str:
        """The database's stable id, made when it was created."""
        return self._producer.producer_id

    def head(self, stream: str) -> int:
        """The last committed seq of ``stream`` (0 if none yet), read from the database:
        this thread's commits and every other writer's included."""
        head = self._session().head(stream)
        if head is None:
            return self._producer.head(stream)  # raises UnknownStreamError
        return head

    def _session(self) -> Session:
        """This thread's connection to the database (made on first use)."""
        session: Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._producer.storage.session(self._producer.durability)
            with self._connections_lock:
                self._sessions.append(session)
            self._local.session = session
        return session

    def transaction(self) -> SyncTransaction:
        """One transaction on the calling thread, as ``with p.transaction() as tx:``:
        commits when the block ends, rolls back if it raises. Threads run their
        transactions on connections of their own."""
        if self._loop.is_closed():
            raise RuntimeError("this SyncProducer is closed")
        committed = self._served if self._serves else None
        return SyncTransaction(self._session(), self._producer.max_record_size, committed)

    def _served(self, tx: SyncTransaction) -> None:
        """After a commit: served now if someone waits for it or for its seqs (else within
        ``commit_watcher.IDLE_CHECK``)."""
        if self._producer.log.waits.count or tx.last_receipt is not None:
            self._loop.call_soon_threadsafe(self._producer.writing.wake)
        if tx.last_receipt is not None:  # numbered after the commit: once served
            self.wait_served(tx.last_receipt)

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> int | Receipt:
        """A transaction holding just this publish; returns the record's seq (on
        PostgreSQL once served, or a ``Receipt`` with ``serve=False``)."""
        with self.transaction() as tx:
            seq = tx.publish(stream, value, key=key, headers=headers)
        if isinstance(seq, Receipt) and self._serves:
            return self.wait_served(seq)[0]  # served: known at once
        return seq

    def wait_served(self, receipt: Receipt, *, timeout: float | None = None) -> range:
        """The seqs of a receipt's records, once served (``Producer.wait_served``)."""
        return self._call(self._producer.wait_served(receipt, timeout=timeout))

    def run_in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tx, *args)`` in one transaction on the calling thread; returns its result."""
        with self.transaction() as tx:
            return fn(tx, *args)

    def query(self, sql: str, parameters: Iterable[Any] = ()) -> list[Any]:
        """Rows of a read-only query on the producer's database."""
        rows: list[Any] = self._session().execute(sql, tuple(parameters)).fetchall()
        return rows

    def create_stream(
        self,
        name: str,
        *,
        key_index: bool = False,
        compact: bool = False,
        notify_compacted: bool = False,
    ) -> None:
        """``Producer.create_stream``."""
        self._call(
            self._producer.create_stream(
                name, key_index=key_index, compact=compact, notify_compacted=notify_compacted
            )
        )

    def compact(self, stream: str) -> list[Compacted]:
        """``Producer.compact``."""
        return self._call_fresh(self._producer.compact(stream))

    def truncate(self, stream: str, before: int) -> None:
        """``Producer.truncate``."""
        self._call_fresh(self._producer.truncate(stream, before))

    def history(self, stream: str, key: bytes, from_seq: int | None = None) -> list[Record]:
        """``Producer.history``."""
        return self._call_fresh(self._producer.history(stream, key, from_seq))

    def seek_time(self, stream: str, timestamp: int) -> int:
        """``Producer.seek_time``."""
        return self._call_fresh(self._producer.seek_time(stream, timestamp))

    def wait_applied(
        self, consumer: str, stream: str, seq: int, *, timeout: float | None = None
    ) -> int:
        """Block until ``consumer`` reports ``stream`` applied up to ``seq``; see ``Producer``."""
        return self._call(self._producer.wait_applied(consumer, stream, seq, timeout=timeout))

    def consumer_lags(self) -> list[ConsumerLag]:
        """``Producer.consumer_lags``, after catching up with other writers."""
        self._call(self._producer.refresh())
        return self._producer.consumer_lags()

    def register_consumer(
        self,
        consumer: str,
        stream: str,
        *,
        max_idle_ms: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """``Producer.register_consumer``, limits included."""
        self._call_fresh(
            self._producer.register_consumer(
                consumer, stream, max_idle_ms=max_idle_ms, max_bytes=max_bytes
            )
        )

    def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """``Producer.unregister_consumer``."""
        return self._call_fresh(self._producer.unregister_consumer(consumer, stream))

    def forget_consumer(self, consumer: str, stream: str) -> bool:
        """``Producer.forget_consumer``: its registration and its last known position."""
        return self._call_fresh(self._producer.forget_consumer(consumer, stream))

    def apply_retention(self) -> list[Truncation]:
        """``Producer.apply_retention``."""
        return self._call_fresh(self._producer.apply_retention())
