"""What the application holds, reduced to the DB-API connection under it, in a transaction.

``streamq.publish`` and ``save_position`` write through the application's own
connection, so their rows commit or roll back with the application's. Each kind of
connection says in its own way whether a transaction is open; this module asks it, and
refuses one that has none (``NotInTransactionError``): a record written in autocommit
mode would commit alone, apart from the business writes it belongs with.

Supported: ``sqlite3.Connection``; psycopg 3's ``Connection`` (PostgreSQL); SQLAlchemy's
``Connection`` and ``Session`` on either (a transaction is begun as SQLAlchemy's own
autobegin would), on PostgreSQL through psycopg or, inside ``AsyncConnection.run_sync``,
asyncpg; Django's ``connection`` inside ``transaction.atomic()``; and, for ``*_async``,
``aiosqlite.Connection``, psycopg's ``AsyncConnection``, asyncpg's ``Connection`` (or a
pool's), and SQLAlchemy's ``AsyncConnection`` and ``AsyncSession`` (``sqlite+aiosqlite``,
``postgresql+psycopg``, ``postgresql+asyncpg``). SQLAlchemy, Django, psycopg and asyncpg
are never imported before such an object is passed: objects are recognised by their
module, so none of them is a dependency.
"""

from __future__ import annotations

import functools
import sqlite3
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from ..errors import NotInTransactionError, UnsupportedConnectionError

Engine = Literal["sqlite", "postgresql"]

_SUPPORTED = (
    "a sqlite3.Connection, a psycopg (3) Connection, a SQLAlchemy Connection or Session, or "
    "Django's django.db.connection (streamq.publish, save_position); an "
    "aiosqlite.Connection, a psycopg AsyncConnection, an asyncpg Connection or a "
    "SQLAlchemy AsyncConnection or AsyncSession (streamq.publish_async, save_position_async)"
)


@dataclass(frozen=True, slots=True)
class Operation:
    """The call a connection was passed to, as its errors name it: the same connection
    mistakes are refused for ``publish``, ``create_tables`` and ``save_position``."""

    name: str  # streamq.NAME
    async_name: str | None  # its asyncio twin, if it has one
    sync_name: str  # the blocking twin, named when an asyncio call gets a blocking connection
    commits: str  # what then commits with the application's writes


PUBLISH = Operation("publish", "publish_async", "publish", "the record commits")
CREATE_TABLES = Operation(
    "create_tables", "create_tables_async", "create_tables", "the log tables commit"
)
SAVE_POSITION = Operation(
    "save_position", "save_position_async", "save_position", "the batch's position commits"
)


class Resolved(NamedTuple):
    """The DB-API connection to write through, and which engine's SQL it speaks (a tuple:
    every publish makes one, and a frozen dataclass costs it 0.3 µs more)."""

    engine: Engine
    dbapi: Any


def resolve_engine(conn: Any, op: Operation = PUBLISH) -> Resolved:
    """The DB-API connection to write through and its engine, checked to be in a
    transaction; errors name ``op``, the call ``conn`` was passed to."""
    if isinstance(conn, sqlite3.Connection):
        return Resolved("sqlite", _checked_sqlite(conn, "the sqlite3 connection", op))
    psycopg = _psycopg_kind(conn)
    if psycopg == "sync":
        return Resolved("postgresql", _checked_psycopg(conn, "the psycopg connection", op))
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        return _sqlalchemy(conn, op)
    if module.startswith("django."):
        return _django(conn, op)
    if (
        module.startswith(("aiosqlite", "asyncpg"))
        or _is_sqlalchemy_async(conn)
        or psycopg == "async"
    ):
        use = (
            f"use 'await streamq.{op.async_name}(conn, ...)'"
            if op.async_name
            else f"streamq.{op.name} takes a blocking one"
        )
        raise UnsupportedConnectionError(f"{type(conn).__name__} is an asyncio connection: {use}")
    raise _unsupported(conn, op)


async def resolve_engine_async(conn: Any, op: Operation = PUBLISH) -> Resolved:
    """``resolve_engine`` for asyncio connections: a psycopg ``AsyncConnection`` on
    PostgreSQL; on SQLite the ``aiosqlite.Connection``, whose thread runs the SQL."""
    if type(conn).__module__.startswith("aiosqlite"):
        return Resolved("sqlite", _checked_aiosqlite(conn, "the connection", op))
    if _psycopg_kind(conn) == "async":
        return Resolved("postgresql", _checked_psycopg(conn, "the psycopg connection", op))
    if type(conn).__module__.startswith("asyncpg."):
        return Resolved("postgresql", _checked_asyncpg(conn, "the asyncpg connection", op))
    if not _is_sqlalchemy_async(conn):
        _refuse_blocking(conn, op)
        raise _unsupported(conn, op)
    conn = await _sqlalchemy_async_connection(conn, op)
    engine = _check_sqlalchemy_dialect(conn.dialect.name, conn.dialect.driver)
    raw = await conn.get_raw_connection()
    driver: Any = raw.driver_connection
    if engine == "postgresql" and conn.dialect.driver == "asyncpg":
        if not (raw.dbapi_connection.autocommit or driver.is_in_transaction()):
            # SQLAlchemy's asyncpg adapter begins the transaction it was told to begin at
            # the first statement it runs: one it runs now, so that ours runs inside.
            await conn.exec_driver_sql("SELECT 1")
        return Resolved(engine, _checked_asyncpg(driver, "SQLAlchemy's connection", op))
    if engine == "postgresql":
        return Resolved(engine, _checked_psycopg(driver, "SQLAlchemy's connection", op))
    if type(driver).__module__.split(".")[0] != "aiosqlite":
        raise UnsupportedConnectionError(
            f"SQLAlchemy's asyncio SQLite driver here is {type(driver).__module__}: "
            f"streamq.{op.async_name or op.name} runs on 'sqlite+aiosqlite://'"
        )
    return Resolved(engine, _checked_aiosqlite(driver, "SQLAlchemy's connection", op))


def _checked_asyncpg(conn: Any, what: str, op: Operation) -> Any:
    """An asyncpg connection in a transaction (asyncpg has no autobegin: outside
    ``conn.transaction()`` each statement commits alone); a pool's proxy gives the
    connection it holds, which outlives it (what a connection caches lives with it)."""
    if not conn.is_in_transaction():
        raise NotInTransactionError(
            f"{what} has no transaction open: call streamq.{op.async_name or op.name} inside "
            f"'async with conn.transaction():', so {op.commits} with the application's writes"
        )
    return getattr(conn, "_con", conn)  # asyncpg.pool.PoolConnectionProxy's connection


def _checked_aiosqlite(conn: Any, what: str, op: Operation) -> Any:
    """An aiosqlite connection whose sqlite3 connection is in a transaction (or will open
    one). Read from this thread: the application awaits its statements, so none runs."""
    _checked_sqlite(conn._conn, what, op)
    return conn


def _refuse_blocking(conn: Any, op: Operation) -> None:
    module = type(conn).__module__
    if (
        isinstance(conn, sqlite3.Connection)
        or module.startswith(("sqlalchemy.", "django."))
        or _is_psycopg(conn)
    ):
        raise UnsupportedConnectionError(
            f"{type(conn).__name__} is a blocking connection: "
            f"use 'streamq.{op.sync_name}(conn, ...)'"
        )


def _unsupported(conn: Any, op: Operation) -> UnsupportedConnectionError:
    module = type(conn).__module__
    if module.split(".")[0] == "psycopg2":
        return UnsupportedConnectionError(
            "psycopg2 connections are not supported: streamq writes to PostgreSQL through "
            "psycopg 3 ('pip install streamq[postgres]'; SQLAlchemy: 'postgresql+psycopg://') "
            "or asyncpg ('postgresql+asyncpg://')"
        )
    return UnsupportedConnectionError(
        f"streamq.{op.name} cannot write through a {module}.{type(conn).__qualname__}: "
        f"pass {_SUPPORTED}"
    )


def _is_psycopg(conn: Any) -> bool:
    return type(conn).__module__.split(".")[0] == "psycopg"


def _psycopg_kind(conn: Any) -> Literal["sync", "async"] | None:
    """Whether ``conn`` is psycopg 3's blocking or asyncio connection; asked once per class
    (a publish per request asks again), and psycopg imported only if the class is its."""
    cls = type(conn)
    if cls not in _PSYCOPG_KINDS:
        _PSYCOPG_KINDS[cls] = None
        if cls.__module__.split(".")[0] == "psycopg":
            import psycopg

            if issubclass(cls, psycopg.AsyncConnection):
                _PSYCOPG_KINDS[cls] = "async"
            elif issubclass(cls, psycopg.Connection):
                _PSYCOPG_KINDS[cls] = "sync"
    return _PSYCOPG_KINDS[cls]


_PSYCOPG_KINDS: dict[type, Literal["sync", "async"] | None] = {}


def _checked_psycopg(conn: Any, what: str, op: Operation) -> Any:
    """A psycopg ``Connection`` or ``AsyncConnection`` in a transaction, or about to open
    one: without autocommit, psycopg begins one before the first statement, ours
    included, as it would before the application's."""
    if _psycopg_kind(conn) is None:  # psycopg2 under Django, say
        raise _unsupported(conn, op)
    if conn.autocommit:
        from psycopg.pq import TransactionStatus

        if conn.info.transaction_status == TransactionStatus.IDLE:
            raise NotInTransactionError(
                f"{what} is in autocommit mode with no transaction open: call "
                f"streamq.{op.name} inside 'with conn.transaction():' (or without "
                f"autocommit), so {op.commits} with the application's writes"
            )
    return conn


def _checked_sqlite(conn: sqlite3.Connection, what: str, op: Operation) -> sqlite3.Connection:
    # With isolation_level set (the module's default), sqlite3 itself opens a transaction
    # before the first write, ours included, as it would before the application's.
    if conn.isolation_level is None and not conn.in_transaction:
        raise NotInTransactionError(
            f"{what} is in autocommit mode (isolation_level=None) with no transaction open: "
            f"run BEGIN (BEGIN IMMEDIATE with several writers) before streamq.{op.name}, "
            f"so {op.commits} with the application's writes"
        )
    return conn


def _is_sqlalchemy_async(conn: Any) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.ext.asyncio")


@functools.cache
def _sqlalchemy_types() -> tuple[type[Any], type[Any]]:
    """SQLAlchemy's ``Connection`` and ``Session``, imported once one is passed (an import
    statement costs a microsecond even then, on every publish: held under the write lock)."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    return Connection, Session


def _sqlalchemy(conn: Any, op: Operation) -> Resolved:
    """A SQLAlchemy ``Session`` or ``Connection``: its DB-API connection, in a transaction."""
    Connection, Session = _sqlalchemy_types()
    if isinstance(conn, Session):
        conn = conn.connection()  # begins the session's transaction if it has none
    if not isinstance(conn, Connection):
        raise UnsupportedConnectionError(
            f"streamq.{op.name} cannot write through a SQLAlchemy {type(conn).__name__}: "
            "pass a Connection or a Session (engine.begin(), Session.begin())"
        )
    engine = _check_sqlalchemy_dialect(conn.dialect.name, conn.dialect.driver)
    if not conn.in_transaction():
        conn.begin()  # what SQLAlchemy's autobegin does at the first statement
    dbapi: Any = conn.connection.dbapi_connection
    if engine == "postgresql" and conn.dialect.driver == "asyncpg":
        # An asyncpg connection seen through SQLAlchemy's blocking face (run_sync,
        # Alembic's async template): its adapter begins the transaction at our first
        # statement, unless it is in autocommit mode.
        if dbapi.autocommit:
            raise NotInTransactionError(
                f"SQLAlchemy's connection is in autocommit mode: call streamq.{op.name} "
                f"in a transaction, so {op.commits} with the application's writes"
            )
        return Resolved(engine, dbapi)
    if engine == "postgresql":
        return Resolved(engine, _checked_psycopg(dbapi, "SQLAlchemy's connection", op))
    return Resolved(engine, _checked_sqlite(dbapi, "SQLAlchemy's connection", op))


async def _sqlalchemy_async_connection(conn: Any, op: Operation) -> Any:
    """A SQLAlchemy ``AsyncSession`` or ``AsyncConnection``: its ``AsyncConnection``, in a
    transaction."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()  # begins the session's transaction if it has none
    if not isinstance(conn, AsyncConnection):
        raise UnsupportedConnectionError(
            f"streamq.{op.async_name or op.name} cannot write through a SQLAlchemy "
            f"{type(conn).__name__}: pass an AsyncConnection or an AsyncSession"
        )
    if not conn.in_transaction():
        await conn.begin()
    return conn


def _check_sqlalchemy_dialect(name: str, driver: str) -> Engine:
    """The engine of a SQLAlchemy dialect, or an error naming what streamq writes to."""
    if name == "sqlite":
        return "sqlite"
    if name == "postgresql" and driver in ("psycopg", "asyncpg"):
        return "postgresql"
    if name == "postgresql":
        raise UnsupportedConnectionError(
            f"this SQLAlchemy connection is postgresql+{driver}: streamq writes to PostgreSQL "
            "through psycopg 3 ('postgresql+psycopg://') or asyncpg ('postgresql+asyncpg://')"
        )
    raise UnsupportedConnectionError(
        f"streamq publishes into SQLite and PostgreSQL databases; this SQLAlchemy "
        f"connection is {name}"
    )


def _django(conn: Any, op: Operation) -> Resolved:
    """Django's ``connection`` (or ``connections[alias]``) inside ``transaction.atomic()``."""
    vendor = getattr(conn, "vendor", None)
    if vendor is None:
        raise UnsupportedConnectionError(
            f"streamq.{op.name} cannot write through a Django {type(conn).__name__}: "
            "pass django.db.connection"
        )
    if vendor not in ("sqlite", "postgresql"):
        raise UnsupportedConnectionError(
            f"streamq publishes into SQLite and PostgreSQL databases; Django's connection "
            f"is {vendor}"
        )
    if conn.get_autocommit():
        raise NotInTransactionError(
            f"Django's connection is in autocommit mode: call streamq.{op.name} inside "
            f"'with transaction.atomic():', so {op.commits} with the ORM's writes"
        )
    conn.ensure_connection()
    if vendor == "postgresql":
        return Resolved("postgresql", _checked_psycopg(conn.connection, "Django's connection", op))
    return Resolved("sqlite", _checked_sqlite(conn.connection, "Django's connection", op))
