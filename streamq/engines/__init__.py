"""The database engines: one package each, holding all of that engine's SQL.

``sqlite`` (the embedded default) and ``postgres``. Each has the append path used by
``streamq.publish`` on the application's own connection (``append``), the schema
(``create_schema``), and the storage a serving producer uses.
"""

from __future__ import annotations

from ..storage import Storage, is_postgres_url


def open_storage(target: str) -> Storage:
    """The storage for ``target``: a ``postgresql://`` URL, or a SQLite file's path."""
    if is_postgres_url(target):
        from .postgres.storage import PostgresStorage  # psycopg: an optional extra

        return PostgresStorage(target)
    from .sqlite.storage import SQLiteStorage

    return SQLiteStorage(target)
