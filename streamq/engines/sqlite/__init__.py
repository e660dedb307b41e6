"""The SQLite engine: the embedded default, a producer's log in its own database file."""

from .append import DEFAULT_MAX_RECORD_SIZE, append, append_async, create_schema

__all__ = ["DEFAULT_MAX_RECORD_SIZE", "append", "append_async", "create_schema"]
