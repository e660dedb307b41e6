"""A consumer's database kept up: what it asks of its ``PositionStore`` tried again while
the database cannot be used, for at most ``db_reconnect_timeout`` seconds.

The subscription does this for the connection to the producer; ``KeptStore`` does it for
the consumer's own database, whose server may restart (PostgreSQL), or whose write lock
another connection may hold past the busy timeout (SQLite). The store says which of its
errors are such (``PositionStore.unavailable``) and connects again at its next call;
here is when to call again (``Outage``: backoff, as the subscription's), and what each
call may repeat:

- reads (the stored position, the names on a stream) and the dead letters' own
  transactions run again (a parked record is taken by deleting its row in the
  transaction that re-applies it: repeating that transaction cannot apply it twice);
- ``apply`` runs the application's function again in a new transaction, unless it ran to
  the end and the connection failed at COMMIT: then whether the COMMIT landed is not
  known, and the stored position, read again, says (``Batch.last_seq``: it did, and is
  not applied twice; ``Batch.after``: it did not, and is applied again);
- ``transaction`` claims the batch's turn again; the application's block cannot be run
  again, so a connection lost while it runs is raised, noted (nothing committed); one
  lost at COMMIT is resolved by the stored position, as for ``apply``.

Past the bound, ``DatabaseUnavailableError``: one line naming the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from ..errors import DatabaseUnavailableError
from .batch import Batch
from .position_store import ConsumerTransaction, DeadLetterSQL, PositionStore
from .subscription import FIRST_DELAY, MAX_DELAY

T = TypeVar("T")

logger = logging.getLogger("streamq.consumer")


class Outage:
    """The consumer's database unusable since the first failure seen (``error``): waits
    between tries with backoff (``FIRST_DELAY`` doubling to ``MAX_DELAY``, as the
    subscription's), for at most ``timeout`` seconds in all (None: for ever)."""

    def __init__(self, where: str, timeout: float | None, error: BaseException) -> None:
        self.where, self.timeout = where, timeout
        self.started = time.monotonic()
        self._delay = 0.0
        logger.warning(
            "the consumer's %s cannot be used (%s); trying again%s",
            where, one_line(error), "" if timeout is None else f" for up to {timeout:g} s",
        )  # fmt: skip

    async def wait(self, error: BaseException) -> None:
        """After a try that failed with ``error``: wait before the next one, or raise
        ``DatabaseUnavailableError`` when the bound is reached."""
        self.check(error)
        self._delay = min(max(self._delay * 2, FIRST_DELAY), MAX_DELAY)
        delay = self._delay
        if self.timeout is not None:  # the last try at the bound, not a delay before it
            delay = min(delay, self.started + self.timeout - time.monotonic())
        await asyncio.sleep(max(delay, 0.0))

    def check(self, error: BaseException) -> None:
        """``DatabaseUnavailableError`` if the bound is reached, the last failure ``error``."""
        if self.timeout is not None and time.monotonic() - self.started >= self.timeout:
            raise DatabaseUnavailableError(
                f"the consumer's {self.where} could not be used for {self.timeout:g} s "
                f"(db_reconnect_timeout): {one_line(error)}"
            ) from error

    def ended(self) -> None:
        """The database answered again."""
        logger.info(
            "the consumer's %s is usable again (after %.1f s)",
            self.where, time.monotonic() - self.started,
        )  # fmt: skip


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (libpq's have a hint on a second)."""
    return " ".join(str(error).split()) or type(error).__name__


class KeptStore:
    """``store`` (a ``PositionStore``), each call tried again while the database cannot
    be used, for at most ``timeout`` seconds; see the module docstring. Opening it is not
    retried: a database that cannot be opened at start is a mistake to report at once."""

    def __init__(self, store: PositionStore, timeout: float | None) -> None:
        self.store = store
        self.timeout = timeout
        self.where = store.where
        self.dead_letters: DeadLetterSQL = store.dead_letters

    @property
    def connection(self) -> Any:
        return self.store.connection

    async def open(self) -> None:
        await self.store.open()

    async def close(self) -> None:
        await self.store.close()

    def unavailable(self, error: BaseException) -> bool:
        return self.store.unavailable(error)

    async def load(self, consumer: str, stream: str) -> list[tuple[str, int, int, str]]:
        return await self._again(lambda: self.store.load(consumer, stream))

    async def stored(self, consumer: str, producer_id: str, stream: str) -> int | None:
        return await self._again(lambda: self.store.stored(consumer, producer_id, stream))

    async def names_on(
        self, stream: str, producer_id: str, endpoint: str
    ) -> list[tuple[str, str, int]]:
        return await self._again(lambda: self.store.names_on(stream, producer_id, endpoint))

    async def run_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._again(lambda: self.store.run_transaction(fn, *args))

    async def apply(
        self,
        batch: Batch,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        committed: Callable[[], None],
    ) -> T:
        ran: list[T] = []  # fn's result, once it returned: then only COMMIT was left

        def body(tx: Any, batch: Batch, *args: Any) -> T:
            result = fn(tx, batch, *args)
            ran.append(result)
            return result

        outage: Outage | None = None
        while True:
            ran.clear()
            try:
                result = await self.store.apply(batch, body, args, committed)
            except Exception as exc:
                if not self.unavailable(exc):
                    raise
                outage = await self._waited(outage, exc)
                if ran and await self._landed(batch, outage):
                    committed()
                    return ran[0]
                continue  # nothing of it committed: in a new transaction
            if outage is not None:
                outage.ended()
            return result

    @contextlib.asynccontextmanager
    async def transaction(
        self, batch: Batch, committed: Callable[[], None]
    ) -> AsyncIterator[ConsumerTransaction]:
        outage: Outage | None = None
        while True:
            stage = "turn"
            try:
                async with self.store.transaction(batch, committed) as tx:
                    stage = "block"
                    yield tx
                    stage = "commit"
            except Exception as exc:
                if not self.unavailable(exc):
                    raise
                if stage == "block":  # the application's statements: not run again here
                    exc.add_note(
                        f"streamq: the consumer's {self.where} could not be used while the "
                        f"block applying seqs {batch.first_seq}..{batch.last_seq} ran: nothing "
                        "of it committed; apply the batch again (consumer.apply(batch, fn) "
                        "runs fn again by itself)"
                    )
                    raise
                outage = await self._waited(outage, exc)
                if stage == "commit":
                    if await self._landed(batch, outage):
                        committed()
                        return
                    exc.add_note(
                        f"streamq: the connection to the consumer's {self.where} failed at "
                        f"the COMMIT of seqs {batch.first_seq}..{batch.last_seq}, which did not "
                        "land (read again, the stored position is not there): nothing of it "
                        "committed; apply the batch again"
                    )
                    raise
                continue  # the turn, claimed again
            if outage is not None:
                outage.ended()
            return

    async def _waited(self, outage: Outage | None, error: BaseException) -> Outage:
        """``outage`` (begun now if None), waited out once after ``error``."""
        if outage is None:
            outage = Outage(self.where, self.timeout, error)
        await outage.wait(error)
        return outage

    async def _landed(self, batch: Batch, outage: Outage) -> bool:
        """Whether ``batch`` committed, from the position stored (read again): its COMMIT
        failed with the connection, so it may or may not have."""
        stored = await self._again(
            lambda: self.store.stored(batch.consumer, batch.producer_id, batch.stream), outage
        )
        return stored == batch.last_seq

    async def _again(self, call: Callable[[], Awaitable[T]], outage: Outage | None = None) -> T:
        """``call()``, made again while the database cannot be used, within ``outage``'s
        bound (one begun at the first failure, if None)."""
        began = outage is None
        while True:
            try:
                result = await call()
            except Exception as exc:
                if not self.unavailable(exc):
                    raise
                outage = await self._waited(outage, exc)
                continue
            if began and outage is not None:
                outage.ended()
            return result
