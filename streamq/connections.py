"""What the application holds, reduced to the DB-API connection under it, in a transaction.

``streamq.publish`` and ``save_position`` write through the application's own
connection, so their rows commit or roll back with the application's. Each kind of
connection says in its own way whether a transaction is open; this module asks it, and
refuses one that has none (``NotInTransactionError``): a record written in autocommit
mode would commit alone, apart from the business writes it belongs with.

Supported: ``sqlite3.Connection``; SQLAlchemy's ``Connection`` and ``Session`` (a
transaction is begun as SQLAlchemy's own autobegin would); Django's ``connection``
inside ``transaction.atomic()``; and, for ``*_async``, ``aiosqlite.Connection`` and
SQLAlchemy's ``AsyncConnection`` and ``AsyncSession``. SQLAlchemy and Django are never
imported here: objects are recognised by their module, so neither is a dependency.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from .blocking import run_on_thread
from .errors import NotInTransactionError, UnsupportedConnectionError

T = TypeVar("T")

_SUPPORTED = (
    "a sqlite3.Connection, a SQLAlchemy Connection or Session, or Django's "
    "django.db.connection (streamq.publish); an aiosqlite.Connection or a SQLAlchemy "
    "AsyncConnection or AsyncSession (streamq.publish_async)"
)


def resolve(conn: Any) -> Any:
    """The DB-API connection to write through, checked to be in a transaction."""
    if isinstance(conn, sqlite3.Connection):
        return _checked_sqlite(conn, "the sqlite3 connection")
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        return _sqlalchemy(conn)
    if module.startswith("django."):
        return _django(conn)
    if module.startswith("aiosqlite") or _is_sqlalchemy_async(conn):
        raise UnsupportedConnectionError(
            f"{type(conn).__name__} is an asyncio connection: "
            "use 'await streamq.publish_async(conn, ...)'"
        )
    raise UnsupportedConnectionError(
        f"cannot publish through a {type(conn).__module__}.{type(conn).__qualname__}: "
        f"pass {_SUPPORTED}"
    )


async def resolve_async(conn: Any, fn: Callable[[Any], T]) -> T:
    """Run ``fn(dbapi)`` with the DB-API connection under an asyncio connection, where
    that connection runs its statements (aiosqlite's thread, SQLAlchemy's greenlet)."""
    module = type(conn).__module__
    if module.startswith("aiosqlite"):
        raw = conn._conn  # the sqlite3 connection, used only on aiosqlite's thread
        return await run_on_thread(conn, lambda: fn(_checked_sqlite(raw, "the connection")))
    if _is_sqlalchemy_async(conn):
        return await _sqlalchemy_async(conn, fn)
    if isinstance(conn, sqlite3.Connection) or module.startswith(("sqlalchemy.", "django.")):
        raise UnsupportedConnectionError(
            f"{type(conn).__name__} is a blocking connection: use 'streamq.publish(conn, ...)'"
        )
    raise UnsupportedConnectionError(
        f"cannot publish through a {type(conn).__module__}.{type(conn).__qualname__}: "
        f"pass {_SUPPORTED}"
    )


def _checked_sqlite(conn: sqlite3.Connection, what: str) -> sqlite3.Connection:
    # With isolation_level set (the module's default), sqlite3 itself opens a transaction
    # before the first write, ours included, as it would before the application's.
    if conn.isolation_level is None and not conn.in_transaction:
        raise NotInTransactionError(
            f"{what} is in autocommit mode (isolation_level=None) with no transaction open: "
            "run BEGIN (BEGIN IMMEDIATE with several writers) before publishing, so the "
            "record commits with the application's writes"
        )
    return conn


def _is_sqlalchemy_async(conn: Any) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.ext.asyncio")


def _sqlalchemy(conn: Any) -> Any:
    """A SQLAlchemy ``Session`` or ``Connection``: its DB-API connection, in a transaction."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        conn = conn.connection()  # begins the session's transaction if it has none
    if not isinstance(conn, Connection):
        raise UnsupportedConnectionError(
            f"cannot publish through a SQLAlchemy {type(conn).__name__}: pass a "
            "Connection or a Session (engine.begin(), Session.begin())"
        )
    _check_sqlalchemy_dialect(conn.dialect.name)
    if not conn.in_transaction():
        conn.begin()  # what SQLAlchemy's autobegin does at the first statement
    dbapi: Any = conn.connection.dbapi_connection
    return _checked_sqlite(dbapi, "SQLAlchemy's connection")


async def _sqlalchemy_async(conn: Any, fn: Callable[[Any], T]) -> T:
    """A SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` on aiosqlite: ``fn`` runs on
    aiosqlite's thread, where its sqlite3 connection may be used."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()  # begins the session's transaction if it has none
    if not isinstance(conn, AsyncConnection):
        raise UnsupportedConnectionError(
            f"cannot publish through a SQLAlchemy {type(conn).__name__}: pass an "
            "AsyncConnection or an AsyncSession"
        )
    _check_sqlalchemy_dialect(conn.dialect.name)
    if not conn.in_transaction():
        await conn.begin()
    driver: Any = (await conn.get_raw_connection()).driver_connection
    if type(driver).__module__.split(".")[0] != "aiosqlite":
        raise UnsupportedConnectionError(
            f"SQLAlchemy's asyncio SQLite driver here is {type(driver).__module__}: "
            "streamq.publish_async runs on 'sqlite+aiosqlite://'"
        )
    raw = driver._conn
    return await run_on_thread(driver, lambda: fn(_checked_sqlite(raw, "SQLAlchemy's connection")))


def _check_sqlalchemy_dialect(name: str) -> None:
    if name != "sqlite":
        raise UnsupportedConnectionError(
            f"streamq publishes into SQLite databases; this SQLAlchemy connection is {name}"
        )


def _django(conn: Any) -> Any:
    """Django's ``connection`` (or ``connections[alias]``) inside ``transaction.atomic()``."""
    vendor = getattr(conn, "vendor", None)
    if vendor is None:
        raise UnsupportedConnectionError(
            f"cannot publish through a Django {type(conn).__name__}: pass django.db.connection"
        )
    if vendor != "sqlite":
        raise UnsupportedConnectionError(
            f"streamq publishes into SQLite databases; Django's connection is {vendor}"
        )
    if conn.get_autocommit():
        raise NotInTransactionError(
            "Django's connection is in autocommit mode: publish inside "
            "'with transaction.atomic():', so the record commits with the ORM's writes"
        )
    conn.ensure_connection()
    return _checked_sqlite(conn.connection, "Django's connection")
