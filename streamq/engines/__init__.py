"""The database engines: one package each, holding all of that engine's SQL, and one
``Engine`` object each, the only way the code above reaches it.

``sqlite`` (the embedded default) and ``postgres``. An engine is found in one place, by
what the caller holds: ``for_target`` for a database named by a path or a URL,
``for_connection`` / ``for_connection_async`` for the application's own connection.
Code above never branches on an engine's name: it asks the ``Engine``, or its
``features`` (independent capabilities, each commented in ``producer/storage.py``'s
``Features``). Each engine imports its driver only when used (psycopg is an optional
extra).

May import: the shared modules at the top, ``protocol``, and of the two sides and groups
only the interfaces the engines implement and the types those speak
(``producer.storage``, ``producer.append_rule``, ``consumer.position_store``,
``consumer.batch``, ``consumer.resharing``, ``groups.membership``). Never the
``Producer``, the ``Consumer`` or the rest of either side.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import DatabaseOpenError
from ..producer.storage import Storage
from .app_connection import PUBLISH, Operation, resolve_engine, resolve_engine_async
from .base import Engine, ModuleEngine, Tables

__all__ = ["Engine", "ModuleEngine", "Tables", "for_connection", "for_target", "open_storage"]


POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str) -> bool:
    """``target`` names a PostgreSQL database (else a SQLite file, or an unknown scheme)."""
    return target.startswith(POSTGRES_SCHEMES)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SUPPORTED_TARGETS = "a SQLite file's path (shop.db) or a postgresql:// (postgres://) URL"


def for_target(target: str) -> Engine:
    """The engine of a database named by ``target``: a ``postgresql://`` (or
    ``postgres://``) URL is PostgreSQL, a path a SQLite file. Any other ``scheme://`` is
    refused here, naming both, before SQLite would take it for a file's path."""
    if is_postgres_url(target):
        from .postgres.engine import ENGINE as POSTGRES

        return POSTGRES
    url = _URL.match(target)
    if url and url.group().startswith(("postgresql+", "postgres+")):
        driver = url.group()[: -len("://")].partition("+")[2]
        raise DatabaseOpenError(
            f"{url.group()} is SQLAlchemy's form of the URL: streamq opens PostgreSQL through "
            f"its own driver, so give the same URL without '+{driver}' (postgresql://...)"
        )
    if url:
        raise DatabaseOpenError(
            f"cannot open a {url.group()} database: streamq's databases are SQLite or "
            f"PostgreSQL; give {_SUPPORTED_TARGETS}"
        )
    from .sqlite.engine import ENGINE as SQLITE

    return SQLITE


_ENGINES: dict[str, Engine] = {}  # by name, once imported


def _by_name(name: str) -> Engine:
    engine = _ENGINES.get(name)
    if engine is None:
        engine = _ENGINES[name] = for_target("postgresql://" if name == "postgresql" else "")
    return engine


def for_connection(conn: Any, operation: Operation = PUBLISH) -> tuple[Engine, Any]:
    """The engine of the application's connection (``app_connection.resolve_engine``: a
    sqlite3 or psycopg connection, SQLAlchemy's, Django's), and the DB-API connection to
    run its statements on, checked to be in a transaction; errors name ``operation``."""
    resolved = resolve_engine(conn, operation)
    return _by_name(resolved.engine), resolved.dbapi


async def for_connection_async(conn: Any, operation: Operation = PUBLISH) -> tuple[Engine, Any]:
    """``for_connection`` for asyncio connections."""
    resolved = await resolve_engine_async(conn, operation)
    return _by_name(resolved.engine), resolved.dbapi


def open_storage(target: str) -> Storage:
    """The storage for ``target``: a ``postgresql://`` URL, or a SQLite file's path."""
    return for_target(target).open_storage(target)
