"""The application's side of a transaction: awaited statements (``AsyncSQL``), or a
whole transaction run as one plain function on a SQLite connection's own thread.

aiosqlite hops to its connection's thread and back for every statement; on a
loaded machine each hop costs tens of microseconds, more than the statement.
Running a whole transaction (BEGIN, the caller's statements, COMMIT) as one
function on that thread costs one hop. Both sides use it: the producer's
``run_in_transaction`` and the consumer's ``apply``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar, cast

import aiosqlite

from .errors import TransactionClosedError

T = TypeVar("T")

Durability = Literal["normal", "full"]  # how durably a commit is written (guides/durability.md)


def raw_connection(conn: aiosqlite.Connection) -> sqlite3.Connection:
    """The sqlite3 connection inside ``conn``: use it only on its thread (``run_on_thread``)."""
    return conn._conn


async def run_on_thread(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on ``conn``'s own thread, after what is already queued there.

    aiosqlite has no public call for this; ``Connection._execute`` is the one every
    one of its methods goes through.
    """
    execute = cast(Callable[..., Awaitable[T]], conn._execute)
    return await execute(fn, *args)


async def to_the_end(work: Awaitable[T], succeeded: Callable[[], None]) -> T:
    """Await ``work``, then call ``succeeded()`` if it did, even if the caller is cancelled
    meanwhile (then its cancel is re-raised after): what was sent to a connection's thread
    cannot be stopped, and whether it committed must be known before anyone goes on."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    finally:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        if not future.cancelled() and future.exception() is None:
            succeeded()


class InlineBudget:
    """Whether a short transaction may run on the event loop's own thread, saving the hop
    to its connection's thread and back (two thread wake-ups, tens of microseconds on a
    loaded machine): while transactions take under ``seconds`` on average. A long one
    sends the next ones to the thread, until short ones bring the average down."""

    def __init__(self, seconds: float = 0.001) -> None:
        self.seconds = seconds
        self._average = 0.0

    @property
    def fits(self) -> bool:
        return self._average <= self.seconds

    def note(self, seconds: float) -> None:
        """How long one took, wherever it ran."""
        self._average += (seconds - self._average) * 0.2


def in_transaction(conn: sqlite3.Connection, body: Callable[[], T], begun: bool = False) -> T:
    """BEGIN IMMEDIATE (unless ``begun``), ``body()``, COMMIT; ROLLBACK if it raises.
    On the connection's thread."""
    if not begun:
        conn.execute("BEGIN IMMEDIATE")
    try:
        result = body()
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


class Scoped:
    """Valid from BEGIN to COMMIT or ROLLBACK only."""

    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransactionClosedError(self._why_closed())

    def _why_closed(self) -> str:
        return "this transaction has already committed or rolled back"


class AsyncSQL(Scoped):
    """The application's statements inside a transaction, each awaited (one thread hop
    on SQLite, one round trip on PostgreSQL). ``conn`` is an aiosqlite connection or a
    storage writer: anything with awaitable ``execute`` and ``executemany``."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def execute(self, sql: str, parameters: Iterable[Any] = ()) -> Any:
        """Run the application's SQL inside this transaction; the driver's cursor."""
        self._check_open()
        return await self._conn.execute(sql, parameters)

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> Any:
        """``execute`` once per parameter set, in one call to the driver."""
        self._check_open()
        return await self._conn.executemany(sql, parameters)


class BlockingSQL(Scoped):
    """The application's statements inside a transaction that runs on one thread.
    ``conn`` is a DB-API connection or a blocking storage writer."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Any:
        """Run the application's SQL inside this transaction; the driver's cursor."""
        self._check_open()
        return self._conn.execute(sql, parameters)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]]) -> Any:
        """``execute`` once per parameter set, in one call to the driver."""
        self._check_open()
        return self._conn.executemany(sql, parameters)
