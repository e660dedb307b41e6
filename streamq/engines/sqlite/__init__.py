"""The SQLite engine: the embedded default, a producer's log in its own database file.

``storage.py`` holds its tables and every statement a serving producer runs;
``append.py`` the append path of ``streamq.publish`` on the application's connection.
"""

from .append import append, append_async
from .storage import SQLiteStorage, create_schema, create_schema_async

__all__ = ["SQLiteStorage", "append", "append_async", "create_schema", "create_schema_async"]
